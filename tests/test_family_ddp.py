"""Dreamer and MuZero under two-process CPU DDP (gloo): one backward per step, so the gradients
are all-reduced and both ranks end with identical weights (Dreamer's slow critic and
return-normalisation buffers, MuZero's target network included) and optimizer states, while each
rank acts into its own buffer from envs seeded apart (MuZero also samples, reanalyses and
prioritizes on its own)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow  # every test: a two-rank DDP fit in subprocesses

SCRIPT = Path(__file__).resolve().parent / "support" / "family_ddp_fit.py"
STEPS = 6
FAMILIES = {
    # family: (weight prefixes that must train and agree, optimizers, buffers that must agree and be set)
    "dreamer": (("wm.", "actor.", "critic.", "slow_critic."), 3, ("ret_low", "ret_high")),
    "muzero": (("model.", "target_model."), 1, ()),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_two_ranks_share_weights_but_not_envs(tmp_path, family):
    prefixes, optimizers, buffers = FAMILIES[family]
    out = subprocess.run(
        [sys.executable, str(SCRIPT), family, str(tmp_path), str(STEPS), "ddp_fork"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "TMPDIR": str(tmp_path)},  # Lightning's fork launcher leaves an empty mkdtemp folder
    )
    assert out.returncode == 0, out.stderr[-4000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    assert ranks[0]["global_step"] == ranks[1]["global_step"] == STEPS  # one counted step per gradient step
    weights = ranks[0]["weights"]
    for prefix in prefixes:
        keys = [k for k in weights if k.startswith(prefix)]
        assert keys, prefix
        for key in keys:
            torch.testing.assert_close(
                weights[key], ranks[1]["weights"][key], rtol=0, atol=0, msg=f"weights differ across ranks: {key}"
            )
        # ... and they trained (identical because the gradients were averaged, not because nothing moved)
        assert any(not torch.equal(weights[k], ranks[0]["initial"][k]) for k in keys), f"{prefix} did not change"
    for key in buffers:
        assert torch.equal(weights[key], ranks[1]["weights"][key]) and weights[key] != 0
    assert len(ranks[0]["optimizers"]) == optimizers
    for opt0, opt1 in zip(ranks[0]["optimizers"], ranks[1]["optimizers"]):
        assert opt0["state"]
        for pid, state in opt0["state"].items():
            for name, value in state.items():
                torch.testing.assert_close(value, opt1["state"][pid][name], rtol=0, atol=0)
    assert ranks[0]["env_seed"] != ranks[1]["env_seed"]
    assert ranks[0]["env_steps"] == ranks[1]["env_steps"] > 0
    assert ranks[0]["obs_sum"] != ranks[1]["obs_sum"], "both ranks collected the same data"
