"""Run by tests/test_ddp.py and tests/test_actor_modules.py in a subprocess: a 2-process CPU DDP fit of the tiny agent
(or, with ``nodes``, one node of a 2-node run under ``torchrun``).

Each rank writes its final weights, its env seed and its replay buffer to OUT_DIR/rank<r>.pt
(the fit saves ``last.ckpt`` with each rank's buffer beside it). With ``resume`` the fit goes on
from that ``last.ckpt`` and each rank writes the buffer it starts from to OUT_DIR/rank<r>_resumed.pt.
"""

import os
import sys
from pathlib import Path

import torch
from pytorch_lightning.callbacks import Callback

TESTS = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(TESTS), str(TESTS.parent)]  # support.* and this repository's lightning_wm, installed or not

from lightning_wm.cli import Trainer  # noqa: E402
from lightning_wm.data.modules import ReplayDataModule  # noqa: E402
from lightning_wm.data.samplers import SequenceSampler  # noqa: E402
from lightning_wm.data.settings import ActingSettings, ReplaySettings  # noqa: E402
from lightning_wm.envs import EnvConfig  # noqa: E402

from support.tiny_agent import TinyAgent  # noqa: E402


class DumpRankState(Callback):
    def __init__(self, out_dir):
        self.out_dir = out_dir

    def on_train_end(self, trainer, module):
        dm = trainer.datamodule
        torch.save(
            {
                "weights": {k: v.detach().cpu().clone() for k, v in module.state_dict().items()},
                "env_seed": dm.train_env_seeds(),
                "env_steps": dm.pop_env_stats().env_steps,
                "obs_sum": float(SequenceSampler(8).sample(dm.buffer, 64)["obs"].double().abs().sum()),
                "first_obs": dm.buffer.state_dict()["data"]["obs"][:, 0].clone(),  # [envs, 4]: each stream's reset
                "buffer": dm.buffer.state_dict(),
            },
            os.path.join(self.out_dir, f"rank{trainer.global_rank}.pt"),
        )


class DumpResumedBuffer(Callback):
    def __init__(self, out_dir):
        self.out_dir = out_dir

    def on_train_start(self, trainer, module):
        torch.save(
            trainer.datamodule.buffer.state_dict(), os.path.join(self.out_dir, f"rank{trainer.global_rank}_resumed.pt")
        )


def main(out_dir: str, strategy: str, resume: bool = False, actors: bool = False, nodes: bool = False) -> None:
    """``nodes``: one process of a 2-node run, started by ``torchrun --nnodes 2 --node_rank R`` (the
    rank and the rendezvous come from torchrun's environment, as on a cluster)."""
    torch.set_num_threads(1)
    env = EnvConfig("CartPole-v1", num_envs=2, seed=3)
    acting = ActingSettings(num_actors=1, chunk_length=8, timeout_s=240) if actors else ActingSettings()
    data = ReplayDataModule(
        env,
        batch_size=4,
        sampler=SequenceSampler(8),
        prefill=32,
        replay_ratio=0.5,
        replay=ReplaySettings(capacity=2000, save=True),
        acting=acting,
    )
    model = TinyAgent(data.spec)
    dump = DumpResumedBuffer(out_dir) if resume else DumpRankState(out_dir)
    trainer = Trainer(
        accelerator="cpu",
        devices=1 if nodes else 2,
        num_nodes=2 if nodes else 1,
        strategy=strategy,
        max_steps=22 if resume else 20,
        logger=False,
        enable_progress_bar=False,
        callbacks=[dump],
        num_sanity_val_steps=0,
        limit_val_batches=0,
        default_root_dir=out_dir,
        run_name="ddp",
    )
    trainer.fit(model, data, ckpt_path=os.path.join(trainer.checkpoint_dir, "last.ckpt") if resume else None)


if __name__ == "__main__":
    main(
        sys.argv[1],
        sys.argv[2] if len(sys.argv) > 2 else "ddp",
        resume=sys.argv[3:] == ["resume"],
        actors=sys.argv[3:] == ["actors"],
        nodes=sys.argv[3:] == ["nodes"],
    )
