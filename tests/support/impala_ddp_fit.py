"""Run by tests/test_impala_module.py in a subprocess: IMPALA under 2-process CPU DDP, each rank
with its own actor process. Each rank writes its final weights to OUT_DIR/rank<r>.pt."""

import os
import sys
from pathlib import Path

import torch
from pytorch_lightning.callbacks import Callback

TESTS = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(TESTS), str(TESTS.parent)]  # support.* and this repository's lightning_wm, installed or not

from lightning_wm.agents.impala import IMPALA, ActorCriticSettings  # noqa: E402
from lightning_wm.cli import Trainer  # noqa: E402
from lightning_wm.data.modules import UnrollDataModule  # noqa: E402
from lightning_wm.data.settings import ActingSettings  # noqa: E402
from lightning_wm.envs import EnvConfig  # noqa: E402
from lightning_wm.optim import OptimSettings  # noqa: E402

from support.presets import IMPALA_TINY  # noqa: E402


class DumpRankState(Callback):
    def __init__(self, out_dir):
        self.out_dir, self.obs_sum, self.pids = out_dir, 0.0, []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.obs_sum += float(batch["obs"].double().abs().sum())
        if not self.pids:
            self.pids = trainer.datamodule.acting.pool.pids()

    def on_train_end(self, trainer, module):
        torch.save(
            {
                "weights": {k: v.detach().cpu().clone() for k, v in module.state_dict().items()},
                "obs_sum": self.obs_sum,
                "env_steps": module.env_steps,
                "actor_pids": self.pids,
            },
            os.path.join(self.out_dir, f"rank{trainer.global_rank}.pt"),
        )


def main(out_dir: str) -> None:
    torch.set_num_threads(1)
    data = UnrollDataModule(
        EnvConfig("CartPole-v1", num_envs=2, seed=3),
        unroll_length=4,
        batch_size=2,
        acting=ActingSettings(num_actors=1, timeout_s=300),
    )
    model = IMPALA(data.spec, net=ActorCriticSettings(**IMPALA_TINY["net"]), optim=OptimSettings(lr=0.01))
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=8,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        callbacks=[DumpRankState(out_dir)],
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    trainer.fit(model, data)


if __name__ == "__main__":
    main(sys.argv[1])
