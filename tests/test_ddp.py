"""Two-process CPU DDP (gloo): identical weights at the end, distinct env seeds per rank."""

import subprocess
import sys
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parent / "ddp_fit.py"


def test_ddp_two_ranks_share_weights_but_not_envs(tmp_path):
    out = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), "ddp"], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    for key, value in ranks[0]["weights"].items():
        torch.testing.assert_close(value, ranks[1]["weights"][key], msg=f"weights differ across ranks: {key}")
    assert ranks[0]["env_seed"] != ranks[1]["env_seed"]
    assert ranks[0]["env_steps"] == ranks[1]["env_steps"] > 0
    assert ranks[0]["obs_sum"] != ranks[1]["obs_sum"], "both ranks collected the same data"
    # each rank's envs really were seeded with the "train" seeds of its rank (ddp_fit.py: seed 3, 2 envs)
    from lightning_wm.envs import EnvConfig, make_env
    from lightning_wm.seeding import env_seeds

    for rank in (0, 1):
        assert ranks[rank]["env_seed"] == env_seeds(3, 2, "train", rank)
        for i in range(2):
            expected, _ = make_env(EnvConfig("CartPole-v1")).reset(seed=env_seeds(3, 2, "train", rank)[i])
            torch.testing.assert_close(ranks[rank]["first_obs"][i], torch.as_tensor(expected))
