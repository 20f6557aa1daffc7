"""Same seed, same config, CPU: two runs end bit-identical — weights, optimizer states, replay
buffer, counters — and another seed does not (the comparison can fail).

Each family's shipped config is listed with the overrides that shrink it; add new families here.
"""

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from support.presets import DREAMER_TINY, REPLAY_DATA_TINY, data_overrides, model_overrides

pytestmark = pytest.mark.slow  # every test: CLI fits in subprocesses, compared bit for bit

ROOT = Path(__file__).resolve().parents[1]

FAMILIES = {
    "dreamer": [
        "--config",
        str(ROOT / "configs/dreamer/cartpole.yaml"),
        "--trainer.max_steps",
        "6",
        "--trainer.val_check_interval",
        "3",
        "--trainer.checkpoint_every_n_steps",
        "3",
        *model_overrides(DREAMER_TINY),
        *data_overrides(REPLAY_DATA_TINY),
        "--data.init_args.eval.episodes",  # two episodes in two envs, not the preset's one: the
        "2",  # evaluation's env seeds are part of what must repeat
        "--data.init_args.eval.envs",
        "2",
        "--data.init_args.replay.save",
        "true",
        "--trainer.enable_progress_bar",
        "false",
        "--trainer.enable_model_summary",
        "false",
    ],
}


def _fit(workdir: Path, args: list[str]) -> dict[str, Any]:
    """Run ``fit`` in a fresh process (nothing carried over in memory) and return every file of
    its checkpoint folder, loaded, with the run's own folder in stored paths replaced by ``<run>``."""
    workdir.mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, str(ROOT / "main.py"), "fit", *args, "--trainer.run_name", "run"],
        capture_output=True,
        text=True,
        cwd=workdir,
        env=env,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    folder = workdir / "lightning_logs/run/checkpoints"
    loaded = {p.name: torch.load(p, map_location="cpu", weights_only=True) for p in sorted(folder.iterdir())}
    return _relative(loaded, str(workdir))


def _relative(value: Any, root: str) -> Any:
    if isinstance(value, str):
        return value.replace(root, "<run>")
    if isinstance(value, dict):
        return {k: _relative(v, root) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_relative(v, root) for v in value)
    return value


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor (NaN == NaN, -0.0 != 0.0: bit-identical means the same bits)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _differences(a: Any, b: Any, where: str = "") -> list[str]:
    """Paths at which two loaded checkpoints differ (tensors compared bit for bit)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(_bits(a), _bits(b))
        )
        return [] if same else [where]
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{where} keys {sorted(set(a) ^ set(b), key=str)}"]
        return [d for k in a for d in _differences(a[k], b[k], f"{where}/{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{where} length"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _differences(x, y, f"{where}[{i}]")]
    return [] if a == b else [where]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_same_seed_and_config_give_bit_identical_runs_on_cpu(tmp_path, family):
    args = FAMILIES[family]
    other_args = [*args, "--seed_everything", "1", "--data.init_args.env.seed", "1"]
    # the three fits side by side (each its own process, one torch thread): the repeat is compared
    # bit for bit, so running beside one another must not change a bit either
    with ThreadPoolExecutor(3) as pool:
        runs = [pool.submit(_fit, tmp_path / name, a) for name, a in (("a", args), ("b", args), ("c", other_args))]
        first, second, other = (run.result() for run in runs)
    assert sorted(first) == sorted(second)
    last = first["last.ckpt"]
    assert last["state_dict"] and last["optimizer_states"], "nothing to compare"
    assert any(isinstance(v, dict) and "buffer" in v for v in last.values()) or len(first) > 3, (
        "the replay buffer is not in the checkpoint folder"
    )
    assert _differences(first, second) == []
    assert _differences(first["last.ckpt"]["state_dict"], other["last.ckpt"]["state_dict"])
