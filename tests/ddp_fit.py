"""Run by tests/test_ddp.py in a subprocess: a 2-process CPU DDP fit of the tiny agent.

Each rank writes its final weights and its env seed to OUT_DIR/rank<r>.pt.
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
        dm = trainer.datamodule
        torch.save({
            "weights": {k: v.detach().cpu().clone() for k, v in module.state_dict().items()},
            "env_seed": dm.train_env_seeds(),
            "env_steps": dm.collector.stats.env_steps,
            "obs_sum": float(dm.buffer.sample_sequences(64, 8)["obs"].double().abs().sum()),
            "first_obs": dm.buffer.state_dict()["data"]["obs"][:, 0].clone(),  # [envs, 4]: each stream's reset
        }, os.path.join(self.out_dir, f"rank{trainer.global_rank}.pt"))


def main(out_dir: str, strategy: str) -> None:
    torch.set_num_threads(1)
    env = EnvConfig("CartPole-v1", num_envs=2, seed=3)
    data = ReplayDataModule(env, capacity=2000, batch_size=4, sequence_length=8, prefill=32, replay_ratio=0.5)
    model = TinyAgent(data.spec)
    trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=20, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, callbacks=[DumpRankState(out_dir)],
                      num_sanity_val_steps=0, limit_val_batches=0)
    trainer.fit(model, data)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "ddp")
