"""Run by tests/test_muzero_ddp.py in a subprocess: a 2-process CPU DDP fit (gloo) of MuZero on
vector CartPole, built from configs/muzero/cartpole.yaml shrunk, with prioritized replay and
reanalyse, each rank acting into its own buffer.

    python tests/muzero_ddp_fit.py OUT_DIR [STEPS] [STRATEGY]    # STRATEGY: ddp_fork (default), ddp, ddp_spawn

Each rank writes OUT_DIR/rank<r>.pt: its initial and final weights (model and target network),
its optimizer state, env seeds, env steps, a checksum of its buffer's observations and
``trainer.global_step``.
"""

import os
import sys
from pathlib import Path

import torch
import yaml
from pytorch_lightning.callbacks import Callback

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lightning_wm.agents.muzero import MuZero  # noqa: E402
from lightning_wm.cli import Trainer  # noqa: E402
from lightning_wm.data.modules import ReplayDataModule  # noqa: E402
from lightning_wm.data.samplers import WindowSampler  # noqa: E402
from lightning_wm.envs import EnvConfig  # noqa: E402


def _weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}


class DumpRankState(Callback):
    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir
        self.initial: dict[str, torch.Tensor] = {}

    def on_train_start(self, trainer, module) -> None:
        self.initial = _weights(module)

    def on_train_end(self, trainer, module) -> None:
        dm = trainer.datamodule
        n = len(dm.buffer)
        torch.save({
            "initial": self.initial,
            "weights": _weights(module),
            "optimizer": trainer.optimizers[0].state_dict(),
            "global_step": trainer.global_step,
            "env_seed": dm.train_env_seeds(),
            "env_steps": dm.collector.stats.env_steps,
            "obs_sum": float(abs(dm.buffer.column("obs")).sum()),
            "rows": n,
        }, os.path.join(self.out_dir, f"rank{trainer.global_rank}.pt"))


def main(out_dir: str, steps: int, strategy: str) -> None:
    torch.set_num_threads(1)
    config = yaml.safe_load((ROOT / "configs/muzero/cartpole.yaml").read_text())
    model_args = {**config["model"]["init_args"], "num_simulations": 4, "latent_dim": 16, "hidden": 16,
                  "reanalyze_ratio": 0.25, "target_update_period": 2}
    data_args = dict(config["data"]["init_args"])
    data_args.pop("sampler")
    env = EnvConfig(**{**data_args.pop("env"), "num_envs": 2, "seed": 5})
    data_args.update(batch_size=8, prefill=40, eval_episodes=1, eval_envs=1, capacity=2000)
    data = ReplayDataModule(env, sampler=WindowSampler(model_args["num_unroll_steps"], model_args["td_steps"]),
                            **data_args)
    torch.manual_seed(0)  # same initial weights on both ranks (DDP also broadcasts rank 0's at start)
    model = MuZero(data.spec, **model_args)
    trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=steps, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[DumpRankState(out_dir)], num_sanity_val_steps=0, limit_val_batches=1,
                      val_check_interval=steps)
    trainer.fit(model, data)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 6, sys.argv[3] if len(sys.argv) > 3 else "ddp_fork")
