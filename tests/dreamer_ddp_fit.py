"""Run by tests/test_dreamer_ddp.py in a subprocess: a 2-process CPU DDP fit (gloo) of Dreamer
with the debug preset on vector CartPole, built from configs/dreamer/cartpole.yaml.

    python tests/dreamer_ddp_fit.py OUT_DIR [STEPS] [STRATEGY]    # STRATEGY: ddp (default), ddp_fork, ddp_spawn

``ddp_fork`` (what the test uses) forks the already-imported process instead of re-running the
script for rank 1: the same DistributedDataParallel wrapper and gradient all-reduce as ``ddp``,
without a second ~7 s import of torch and Lightning. A validation (evaluation episode and
open-loop prediction) runs at the end under DDP too.

Each rank writes OUT_DIR/rank<r>.pt: its initial and final weights (world model, actor, critic,
slow critic, return-normalisation buffers), its three optimizers' states, its env seed, env
steps, a checksum of its replayed observations and ``trainer.global_step``.
"""

import os
import sys
from pathlib import Path

import torch
import yaml
from pytorch_lightning.callbacks import Callback

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lightning_wm.agents.dreamer import Dreamer  # noqa: E402
from lightning_wm.cli import Trainer  # noqa: E402
from lightning_wm.data.modules import ReplayDataModule  # noqa: E402
from lightning_wm.data.samplers import SequenceSampler  # noqa: E402
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
        torch.save({
            "initial": self.initial,
            "weights": _weights(module),
            "optimizers": [opt.optimizer.state_dict() if hasattr(opt, "optimizer") else opt.state_dict()
                           for opt in trainer.optimizers],
            "global_step": trainer.global_step,
            "env_seed": dm.train_env_seeds(),
            "env_steps": dm.collector.stats.env_steps,
            "obs_sum": float(SequenceSampler(8).sample(dm.buffer, 64)["obs"].double().abs().sum()),
        }, os.path.join(self.out_dir, f"rank{trainer.global_rank}.pt"))


def main(out_dir: str, steps: int, strategy: str) -> None:
    torch.set_num_threads(1)
    config = yaml.safe_load((ROOT / "configs/dreamer/cartpole.yaml").read_text())
    debug = yaml.safe_load((ROOT / "configs/dreamer/presets/debug.yaml").read_text())
    model_args = {**config["model"]["init_args"], **debug["model"]["init_args"]}
    data_args = dict(config["data"]["init_args"])
    env = EnvConfig(**{**data_args.pop("env"), "seed": 5})
    data_args.update(batch_size=4, sequence_length=16, prefill=64, eval_episodes=1, eval_envs=1, capacity=5000)
    data = ReplayDataModule(env, **data_args)
    torch.manual_seed(0)  # same initial weights on both ranks (DDP also broadcasts rank 0's at start)
    model = Dreamer(data.spec, **model_args)
    trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=steps, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[DumpRankState(out_dir)], num_sanity_val_steps=0, limit_val_batches=1,
                      val_check_interval=steps)
    trainer.fit(model, data)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 6, sys.argv[3] if len(sys.argv) > 3 else "ddp")
