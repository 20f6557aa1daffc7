"""Two-process CPU DDP (gloo): identical weights at the end, distinct env seeds per rank."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow  # every test: a two-rank DDP fit in subprocesses

SCRIPT = Path(__file__).resolve().parent / "support" / "ddp_fit.py"


def test_ddp_two_ranks_share_weights_but_not_envs(tmp_path):
    out = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path), "ddp"], capture_output=True, text=True, timeout=300
    )
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


def test_ddp_resume_gives_each_rank_its_own_buffer_back(tmp_path):
    """Every rank saves its buffer beside last.ckpt and loads its own on resume (episode ended at
    the restart), not rank 0's."""
    for args in ([], ["resume"]):
        out = subprocess.run(
            [sys.executable, str(SCRIPT), str(tmp_path), "ddp", *args], capture_output=True, text=True, timeout=300
        )
        assert out.returncode == 0, out.stderr[-4000:]
    files = sorted(p.name for p in (tmp_path / "lightning_logs" / "ddp" / "checkpoints").glob("replay_*"))
    assert files == [
        "replay_rank0_step20.pt",
        "replay_rank0_step22.pt",
        "replay_rank1_step20.pt",
        "replay_rank1_step22.pt",
    ]
    saved = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False)["buffer"] for r in (0, 1)]
    resumed = [torch.load(tmp_path / f"rank{r}_resumed.pt", weights_only=False) for r in (0, 1)]
    assert not torch.equal(saved[0]["data"]["obs"], saved[1]["data"]["obs"])
    for before, after in zip(saved, resumed):
        newest = (before["pos"] - 1) % 1000
        assert torch.all(after["data"]["is_last"][torch.arange(2), newest])
        assert torch.all(after["data"]["action"][torch.arange(2), newest] == 0)
        before["data"]["is_last"][torch.arange(2), newest] = True
        before["data"]["action"][torch.arange(2), newest] = 0
        for key in ("pos", "count", "written", "generation"):
            assert torch.equal(after[key], before[key]), key
        for key, value in before["data"].items():
            assert torch.equal(after["data"][key], value), key


def test_two_nodes_from_torchrun_share_weights_but_not_envs(tmp_path):
    """A 2-node x 1-process run launched the way a cluster launches it: one ``torchrun
    --nnodes 2 --node_rank R`` per node against one rendezvous (here both on this machine); the
    ranks end with identical weights, each with its own envs and buffer."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    nodes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--nproc_per_node",
                "1",
                "--node_rank",
                str(rank),
                "--master_addr",
                "127.0.0.1",
                "--master_port",
                str(port),
                str(SCRIPT),
                str(tmp_path),
                "ddp",
                "nodes",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "TMPDIR": str(tmp_path)},  # torchrun's agent leaves its log folder in the temp dir
        )  # fmt: skip
        for rank in (0, 1)
    ]
    try:
        outputs = [node.communicate(timeout=300) for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    for node, (_, err) in zip(nodes, outputs):
        assert node.returncode == 0, err[-4000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    for key, value in ranks[0]["weights"].items():
        torch.testing.assert_close(value, ranks[1]["weights"][key], msg=f"weights differ across nodes: {key}")
    assert ranks[0]["env_seed"] != ranks[1]["env_seed"]
    assert ranks[0]["obs_sum"] != ranks[1]["obs_sum"], "both nodes collected the same data"
    files = sorted(p.name for p in (tmp_path / "lightning_logs" / "ddp" / "checkpoints").glob("replay_*"))
    assert files == ["replay_rank0_step20.pt", "replay_rank1_step20.pt"], "each node saved its own buffer"
