"""Run by tests/test_actor_modules.py in a subprocess: a 2-rank CPU DDP fit of the tiny agent
whose replay is filled by one actor process per rank.

Each rank writes its final weights and the first row of each buffer stream to OUT_DIR/rank<r>.pt.
"""

import os
import sys

import torch
from pytorch_lightning.callbacks import Callback

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root, installed or not

from lightning_wm.cli import Trainer  # noqa: E402
from lightning_wm.data.modules import ReplayDataModule  # noqa: E402
from lightning_wm.envs import EnvConfig  # noqa: E402
from tiny_agent import TinyAgent  # noqa: E402


class DumpRankState(Callback):
    def __init__(self, out_dir):
        self.out_dir = out_dir

    def on_train_end(self, trainer, module):
        buffer = trainer.datamodule.buffer
        torch.save({
            "weights": {k: v.detach().cpu().clone() for k, v in module.state_dict().items()},
            "first_obs": torch.as_tensor(buffer.column("obs")[:, 0]),  # [streams, 4]: each env's first reset
            "rows": buffer.rows_per_stream.tolist(),
        }, os.path.join(self.out_dir, f"rank{trainer.global_rank}.pt"))


def main(out_dir: str) -> None:
    torch.set_num_threads(1)
    data = ReplayDataModule(EnvConfig("CartPole-v1", seed=3), capacity=2000, batch_size=4, sequence_length=8,
                            prefill=32, replay_ratio=0.5, num_actors=1, envs_per_actor=2, chunk_length=8,
                            actor_timeout_s=240)
    trainer = Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=15, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, callbacks=[DumpRankState(out_dir)],
                      num_sanity_val_steps=0, limit_val_batches=0)
    trainer.fit(TinyAgent(data.spec), data)


if __name__ == "__main__":
    main(sys.argv[1])
