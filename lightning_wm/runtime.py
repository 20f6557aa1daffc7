"""Process-level settings for CPU training speed."""

from __future__ import annotations

import ctypes

import torch

_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3


def keep_freed_memory() -> bool:
    """Ask glibc's malloc to keep freed memory in the process instead of returning it to the OS.

    A training step allocates the same large temporaries every time (Dreamer XS: ``[16, 1024,
    255]`` critic logits, ~84 MB of stacked imagined features). With glibc's defaults each is
    ``mmap``-ed and unmapped again, so every step page-faults fresh zeroed pages in; inside the
    2-core VM this project is benchmarked on that cost 2-9% of a CPU step (``python
    bench/dreamer_speed.py`` with and without ``--no-malloc-tuning``). Raising the mmap threshold
    to 32 MB and disabling trimming lets the step reuse its own freed blocks. Same effect as ``MALLOC_MMAP_THRESHOLD_=33554432
    MALLOC_TRIM_THRESHOLD_=2147483647`` in the environment. The process's resident memory then
    stays at its peak. Returns False (and changes nothing) where libc is not glibc.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    ok = mallopt(_M_MMAP_THRESHOLD, 32 << 20) and mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)
    return bool(ok and mallopt(_M_TOP_PAD, 64 << 20))


def flush_denormals() -> bool:
    """Treat denormal floats (below ``torch.finfo(dtype).tiny``) as zero in this process's CPU math:
    the SSE flags flush-to-zero and denormals-are-zero, as JAX/XLA and TensorFlow set them on CPUs.

    Without them a long CPU fit slows down as weights and Adam's second moments decay into the
    denormal range, where every multiply takes a slow microcode path: MuZero on MinAtar Breakout
    (``configs/muzero/minatar.yaml``, one thread) went from 0.064 to 0.42 CPU s per gradient step
    between steps 1,000 and 2,000 (18% of its weights denormal); with the flags it stays at
    0.064-0.076 s.

    The flags belong to a thread and new threads inherit them: call this before torch starts its
    intra-op threads (the CLI does it first thing) or those threads keep the IEEE behaviour.
    Returns False (and changes nothing) on CPUs without the flags (``torch.set_flush_denormal``).
    """
    return bool(torch.set_flush_denormal(True))
