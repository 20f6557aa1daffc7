"""Benchmark the ReplayBuffer on a pixel workload and print a markdown table.

Default: 1,000,000 rows of 64x64x3 uint8 over 8 env streams, memory-mapped in a
temporary directory (about 12.3 GB on disk); rows are added in batches of 8 (one row
per stream) and in chunks of 64 x 8 rows (as actors deliver them), then batches of 16
sequences x 64 steps are sampled, uniform and prioritized, and MuZero-style unroll windows. Goal: a 16x64 batch in <= 5 ms (median).

    python bench/replay.py --rows 200000
    python bench/replay.py --rows 200000 --in-memory
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lightning_wm.data.replay import ReplayBuffer  # noqa: E402
from lightning_wm.data.samplers import RowSampler, SequenceSampler, WindowSampler  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=1_000_000, help="buffer capacity in rows (all streams)")
    p.add_argument("--envs", type=int, default=8, help="env streams (rows per add)")
    p.add_argument("--size", type=int, default=64, help="frame height and width")
    p.add_argument("--batch", type=int, default=16, help="sequences per batch")
    p.add_argument("--length", type=int, default=64, help="sequence length")
    p.add_argument("--repeats", type=int, default=200, help="sampled batches per measurement")
    p.add_argument("--in-memory", action="store_true", help="keep arrays in RAM instead of memory-mapped files")
    p.add_argument("--dir", default=None, help="parent directory for the memory-mapped files (default: system temp)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def median_ms(fn, repeats: int, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


Row = tuple[str, str, str]


def measure_adds(buf: ReplayBuffer, pool: np.ndarray, actions: np.ndarray, E: int) -> list[Row]:
    """Time adding rows: a first fill of the buffer, 8 rows per call into the full ring, and chunks of 64 x 8 rows."""
    steps = buf.cap_per_stream
    zeros_f, ones_b = np.zeros(E, np.float32), np.ones(E, bool)
    zeros_b = np.zeros(E, bool)

    def add(t: int) -> None:
        first = ones_b if t % 500 == 0 else zeros_b
        buf.add(
            {
                "obs": pool[t % len(pool)],
                "reward": zeros_f,
                "is_first": first,
                "is_last": zeros_b,
                "is_terminal": zeros_b,
                "action": actions[t % steps],
            }
        )

    start = time.perf_counter()
    for t in range(steps):  # first fill: every page is touched for the first time
        add(t)
    buf.flush()
    add_s = time.perf_counter() - start
    again = min(steps, 5000)
    start = time.perf_counter()
    for t in range(steps, steps + again):  # ring full: overwrite the oldest rows
        add(t)
    again_s = time.perf_counter() - start
    T = 64  # chunks of T rows per stream, as actors deliver them
    chunk = {
        "obs": pool[np.arange(T) % len(pool)],
        "reward": np.zeros((T, E), np.float32),
        "is_first": np.zeros((T, E), bool),
        "is_last": np.zeros((T, E), bool),
        "is_terminal": np.zeros((T, E), bool),
        "action": actions[:T],
    }
    chunks = max(1, min(steps, 5000) // T)
    start = time.perf_counter()
    for _ in range(chunks):
        buf.add_many(chunk)
    chunk_s = time.perf_counter() - start
    return [
        ("add 8 rows/call, first fill", f"{len(buf) / add_s:,.0f} rows/s", f"{add_s / steps * 1e3:.3f}"),
        ("add 8 rows/call, ring full", f"{again * E / again_s:,.0f} rows/s", f"{again_s / again * 1e3:.3f}"),
        (
            f"add_many {T}x{E} rows/call, ring full",
            f"{chunks * T * E / chunk_s:,.0f} rows/s",
            f"{chunk_s / chunks * 1e3:.3f}",
        ),
    ]


def spread_priorities(buf: ReplayBuffer, rng: np.random.Generator, E: int) -> None:
    """Give every row of the buffer a non-trivial priority, in blocks of 2**18 rows."""
    n = E * buf.cap_per_stream
    for lo in range(0, n, 1 << 18):
        idx = np.arange(lo, min(n, lo + (1 << 18)))
        buf.update_priorities(idx, rng.uniform(0.1, 10.0, size=idx.size))


def uniform_view(buf: ReplayBuffer) -> ReplayBuffer:
    """The same storage, sampled uniformly: a shallow copy without the sum tree."""
    uniform = copy.copy(buf)
    uniform._tree, uniform.prioritized = None, False
    return uniform


def measure_sampling(buf: ReplayBuffer, uniform: ReplayBuffer, B: int, L: int, repeats: int) -> list[Row]:
    """Time the samplers (sequences, rows, unroll windows) and priority updates, as median ms per call."""
    rows = []
    for name, b, cross in [
        ("uniform", uniform, True),
        ("prioritized", buf, True),
        ("uniform, no episode crossing", uniform, False),
        ("prioritized, no episode crossing", buf, False),
    ]:
        sampler = SequenceSampler(L, cross_episodes=cross)
        ms = median_ms(lambda: sampler.sample(b, B), repeats)
        rows.append((f"SequenceSampler {B}x{L}, {name}", f"{1e3 / ms:,.0f} batches/s", f"{ms:.2f}"))
    ms = median_ms(lambda: RowSampler().sample(buf, 256), repeats)
    rows.append(("RowSampler 256 rows, prioritized", f"{1e3 / ms:,.0f} batches/s", f"{ms:.2f}"))
    windows = WindowSampler(num_unroll_steps=5, td_steps=5)
    ms = median_ms(lambda: windows.sample(buf, 4 * B), repeats)
    rows.append(
        (
            f"WindowSampler {4 * B}x{windows.window} (K=5, td=5), prioritized",
            f"{1e3 / ms:,.0f} batches/s",
            f"{ms:.2f}",
        )
    )
    batch = SequenceSampler(L).sample(buf, B)
    idx, gen = batch["index"], batch["generation"]
    ms = median_ms(lambda: buf.update_priorities(idx, np.random.uniform(0.1, 10.0, B), gen), repeats)
    rows.append((f"update_priorities {B} (generation-checked)", f"{1e3 / ms:,.0f} calls/s", f"{ms:.3f}"))
    return rows


def print_table(buf: ReplayBuffer, S: int, E: int, storage: Path | None, rows: list[Row]) -> None:
    """Print the buffer's size and mode, then the markdown table of measurements."""
    mode = "in memory" if storage is None else "memory-mapped"
    gb = len(buf) * S * S * 3 / 1e9
    print(f"\nReplayBuffer: {len(buf):,} rows of {S}x{S}x3 uint8 ({gb:.1f} GB), {E} streams, {mode}\n")
    print("| operation (prioritized buffer unless noted) | throughput | ms per call (median for sampling) |")
    print("| --- | ---: | ---: |")
    for op, thr, ms in rows:
        print(f"| {op} | {thr} | {ms} |")


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    E, S = args.envs, args.size
    rng = np.random.default_rng(args.seed)
    # a pool of distinct frames to add, so that generating them is not what we time
    pool = rng.integers(0, 256, size=(16, E, S, S, 3), dtype=np.uint8)
    tmp = None if args.in_memory else tempfile.TemporaryDirectory(dir=args.dir, prefix="replay-bench-")
    storage = None if tmp is None else Path(tmp.name)
    buf = uniform = None
    try:
        buf = ReplayBuffer(args.rows, E, prioritized=True, storage_dir=storage, seed=args.seed)
        actions = rng.integers(0, 6, size=(buf.cap_per_stream, E))
        rows = measure_adds(buf, pool, actions, E)
        spread_priorities(buf, rng, E)
        uniform = uniform_view(buf)
        rows += measure_sampling(buf, uniform, args.batch, args.length, args.repeats)
        print_table(buf, S, E, storage, rows)
    finally:
        if tmp is not None:
            del buf, uniform
            tmp.cleanup()


if __name__ == "__main__":
    main()
