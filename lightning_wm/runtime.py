"""Process-level settings for CPU training speed."""

from __future__ import annotations

import ctypes

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
