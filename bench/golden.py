"""Golden runs: a short seeded fit of every family's shipped config (shrunk, acting in process, CPU),
hashed, so that a refactor can show it changed no bit.

Each run is ``python main.py fit`` in a fresh process; its ``last.ckpt`` is loaded and every tensor
of the weights, the optimizer states and the datamodule state (replay buffer, counters) is hashed
(sha256 over the raw bytes, in key order). ``--save FILE`` writes the hashes; ``--compare FILE``
runs again and prints ``same`` or ``different`` per run (and the first differing keys).

    python bench/golden.py --save /tmp/golden_before.json          # on the old code
    python bench/golden.py --compare /tmp/golden_before.json       # on the new: every run "same"
    python bench/golden.py --compare /tmp/golden_before.json --runs dreamer_cartpole muzero_cartpole
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from support.presets import (  # noqa: E402  (the tests' tiny sizes: one place for them)
    DREAMER_TINY,
    IMPALA_TINY,
    MUZERO_DATA_TINY,
    MUZERO_TINY,
    REPLAY_DATA_TINY,
    UNROLL_DATA_TINY,
    data_overrides,
    model_overrides,
)

COMMON = [
    "--seed_everything",
    "3",
    "--trainer.enable_progress_bar",
    "false",
    "--trainer.enable_model_summary",
    "false",
    "--trainer.accelerator",
    "cpu",
]


def _config(path: str) -> list[str]:
    return ["--config", str(ROOT / "configs" / path)]


def _steps(n: int) -> list[str]:
    return ["--trainer.max_steps", str(n), "--trainer.val_check_interval", str(n)]


#: run name -> the fit's arguments (a shipped config and the tests' tiny overrides).
RUNS: dict[str, list[str]] = {
    "dreamer_cartpole": [
        *_config("dreamer/cartpole.yaml"),
        *_steps(6),
        *model_overrides(DREAMER_TINY),
        *data_overrides(REPLAY_DATA_TINY),
        "--data.init_args.replay.save",
        "true",
    ],
    "dreamer_pendulum": [
        *_config("dreamer/pendulum.yaml"),
        *_steps(6),
        *model_overrides(DREAMER_TINY),
        *data_overrides(REPLAY_DATA_TINY),
    ],
    "muzero_cartpole": [
        *_config("muzero/cartpole.yaml"),
        *_steps(6),
        *model_overrides(MUZERO_TINY),
        *data_overrides(MUZERO_DATA_TINY),
        "--model.init_args.reanalyse.ratio",
        "0.5",
    ],
    "impala_cartpole": [
        *_config("impala/cartpole.yaml"),
        *_steps(8),
        *model_overrides(IMPALA_TINY),
        *data_overrides(UNROLL_DATA_TINY),
        "--data.init_args.acting.num_actors",
        "0",
    ],
    "impala_minatar": [
        *_config("impala/minatar.yaml"),
        *_steps(8),
        *data_overrides({"env": {"num_envs": 2}, "unroll_length": 4, "batch_size": 2}),
        *data_overrides({"eval": {"episodes": 1, "envs": 1}}),
        "--data.init_args.env.max_episode_steps",
        "30",
    ],
    "dyna_cartpole": [
        *_config("impala/cartpole_dyna.yaml"),
        *_steps(8),
        *data_overrides(UNROLL_DATA_TINY),
        "--data.init_args.acting.num_actors",
        "0",
    ],
}


def _tensor_hashes(value: Any, where: str, out: dict[str, str]) -> None:
    import torch

    if isinstance(value, torch.Tensor):
        raw = value.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        out[where] = hashlib.sha256(raw + str((value.dtype, tuple(value.shape))).encode()).hexdigest()[:16]
    elif isinstance(value, dict):
        for key in sorted(value, key=str):
            _tensor_hashes(value[key], f"{where}/{key}", out)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _tensor_hashes(item, f"{where}[{i}]", out)
    elif isinstance(value, (int, float, bool)) and where.count("/") <= 3:
        out[where] = repr(value)


def run_one(name: str) -> dict[str, str]:
    """Fit ``RUNS[name]`` in a fresh process and return its last checkpoint's hashes by key."""
    import torch

    with tempfile.TemporaryDirectory() as work:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, str(ROOT / "main.py"), "fit", *RUNS[name], *COMMON, "--trainer.run_name", "golden"]
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=work, env=env, timeout=900)
        if done.returncode != 0:
            raise RuntimeError(f"{name}: fit failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
        ckpt = torch.load(Path(work) / "lightning_logs/golden/checkpoints/last.ckpt", weights_only=False)
    hashes: dict[str, str] = {}
    for key in ("state_dict", "optimizer_states", "global_step"):
        _tensor_hashes(ckpt.get(key), key, hashes)
    for key, value in ckpt.items():
        if isinstance(value, dict) and key not in ("state_dict", "callbacks", "loops", "hyper_parameters"):
            _tensor_hashes(value, key, hashes)
    return hashes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", nargs="+", choices=sorted(RUNS), default=sorted(RUNS))
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--save", help="write the hashes to this JSON file")
    group.add_argument("--compare", help="compare with the hashes in this JSON file")
    args = parser.parse_args()
    reference = json.loads(Path(args.compare).read_text()) if args.compare else {}
    results: dict[str, dict[str, str]] = {}
    for name in args.runs:
        results[name] = run_one(name)
        if args.compare:
            old = reference.get(name)
            if old is None:
                print(f"{name}: not in {args.compare}")
                continue
            diff = sorted(k for k in set(old) | set(results[name]) if old.get(k) != results[name].get(k))
            print(f"{name}: {'same' if not diff else 'different'} ({len(results[name])} entries)")
            for key in diff[:8]:
                print(f"    {key}: {old.get(key)} -> {results[name].get(key)}")
        else:
            print(f"{name}: {len(results[name])} entries hashed", flush=True)
    if args.save:
        Path(args.save).write_text(json.dumps(results, indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
