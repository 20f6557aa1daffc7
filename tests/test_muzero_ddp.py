"""MuZero under two-process CPU DDP (gloo): each rank acts into its own buffer (envs seeded apart),
samples, reanalyses and prioritizes on its own, and the gradient all-reduce keeps the model, the
target network and the optimizer state identical on both ranks."""

import subprocess
import sys
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parent / "muzero_ddp_fit.py"
STEPS = 6


def test_muzero_ddp_two_ranks_share_weights_but_not_envs(tmp_path):
    out = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), str(STEPS), "ddp_fork"], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    assert ranks[0]["global_step"] == ranks[1]["global_step"] == STEPS
    weights = ranks[0]["weights"]
    for prefix in ("model.", "target_model."):
        keys = [k for k in weights if k.startswith(prefix)]
        assert keys, prefix
        for key in keys:
            torch.testing.assert_close(weights[key], ranks[1]["weights"][key], rtol=0, atol=0,
                                       msg=f"weights differ across ranks: {key}")
        assert any(not torch.equal(weights[k], ranks[0]["initial"][k]) for k in keys), f"{prefix} did not change"
    opt0, opt1 = ranks[0]["optimizer"], ranks[1]["optimizer"]
    assert opt0["state"]
    for pid, state in opt0["state"].items():
        for name, value in state.items():
            torch.testing.assert_close(value, opt1["state"][pid][name], rtol=0, atol=0)
    assert ranks[0]["env_seed"] != ranks[1]["env_seed"]
    assert ranks[0]["env_steps"] == ranks[1]["env_steps"] > 0
    assert ranks[0]["obs_sum"] != ranks[1]["obs_sum"], "both ranks collected the same data"
