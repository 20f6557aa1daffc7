"""Run by tests/test_family_ddp.py in a subprocess: a 2-process CPU DDP fit (gloo) of one family,
built from its CartPole config shrunk to the tiny presets, each rank acting into its own buffer.

    python tests/family_ddp_fit.py FAMILY OUT_DIR [STEPS] [STRATEGY]   # FAMILY: dreamer | muzero
                                                                        # STRATEGY: ddp_fork (default), ddp, ddp_spawn

``ddp_fork`` (what the test uses) forks the already-imported process instead of re-running the
script for rank 1: the same DistributedDataParallel wrapper and gradient all-reduce as ``ddp``,
without a second ~7 s import of torch and Lightning. A validation (evaluation episode) runs at
the end under DDP too.

Each rank writes OUT_DIR/rank<r>.pt: its initial and final weights (buffers included), its
optimizers' states, its env seeds, env steps, a checksum of its buffer's observations and
``trainer.global_step``.
"""

import os
import sys
from pathlib import Path
from typing import Any

import torch
import yaml
from pytorch_lightning.callbacks import Callback

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
sys.path[:0] = [str(TESTS), str(ROOT)]  # support.* and this repository's lightning_wm, installed or not

from lightning_wm.cli import Trainer  # noqa: E402
from lightning_wm.data.modules import ReplayDataModule  # noqa: E402
from lightning_wm.data.samplers import SequenceSampler  # noqa: E402
from lightning_wm.envs import EnvConfig  # noqa: E402

from support.presets import DREAMER_TINY, MUZERO_TINY, merged  # noqa: E402


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
        torch.save(
            {
                "initial": self.initial,
                "weights": _weights(module),
                "optimizers": [
                    opt.optimizer.state_dict() if hasattr(opt, "optimizer") else opt.state_dict()
                    for opt in trainer.optimizers
                ],
                "global_step": trainer.global_step,
                "env_seed": dm.train_env_seeds(),
                "env_steps": dm.collector.stats.env_steps,
                "obs_sum": float(abs(dm.buffer.column("obs")).sum()),
            },
            os.path.join(self.out_dir, f"rank{trainer.global_rank}.pt"),
        )


def _config(path: str) -> tuple[dict[str, Any], dict[str, Any]]:
    config = yaml.safe_load((ROOT / path).read_text())
    return dict(config["model"]["init_args"]), dict(config["data"]["init_args"])


def build_dreamer() -> tuple[torch.nn.Module, ReplayDataModule]:
    from lightning_wm.agents.dreamer import Dreamer

    model_args, data_args = _config("configs/dreamer/cartpole.yaml")
    model_args = merged(model_args, DREAMER_TINY)
    env = EnvConfig(**{**data_args.pop("env"), "seed": 5})
    data_args.update(
        batch_size=4,
        sampler=SequenceSampler(16),
        prefill=64,
        eval={"episodes": 1, "envs": 1},
        replay={**data_args["replay"], "capacity": 5000},
    )
    data = ReplayDataModule(env, **data_args)
    torch.manual_seed(0)  # same initial weights on both ranks (DDP also broadcasts rank 0's at start)
    return Dreamer(data.spec, **model_args), data


def build_muzero() -> tuple[torch.nn.Module, ReplayDataModule]:
    """Prioritized replay and reanalyse on, each rank sampling and reanalysing its own buffer."""
    from lightning_wm.agents.muzero import MuZero
    from lightning_wm.data.samplers import WindowSampler

    model_args, data_args = _config("configs/muzero/cartpole.yaml")
    model_args = merged(model_args, MUZERO_TINY)
    model_args.update(reanalyse={"ratio": 0.25}, target={"update_period": 2})
    data_args.pop("sampler")
    env = EnvConfig(**{**data_args.pop("env"), "num_envs": 2, "seed": 5})
    data_args.update(
        batch_size=8, prefill=40, eval={"episodes": 1, "envs": 1}, replay={**data_args["replay"], "capacity": 2000}
    )
    unroll = model_args["unroll"]
    data = ReplayDataModule(env, sampler=WindowSampler(unroll["num_unroll_steps"], unroll["td_steps"]), **data_args)
    torch.manual_seed(0)
    return MuZero(data.spec, **model_args), data


FAMILIES = {"dreamer": build_dreamer, "muzero": build_muzero}


def main(family: str, out_dir: str, steps: int, strategy: str) -> None:
    torch.set_num_threads(1)
    model, data = FAMILIES[family]()
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[DumpRankState(out_dir)],
        num_sanity_val_steps=0,
        limit_val_batches=1,
        val_check_interval=steps,
    )
    trainer.fit(model, data)


if __name__ == "__main__":
    main(
        sys.argv[1],
        sys.argv[2],
        int(sys.argv[3]) if len(sys.argv) > 3 else 6,
        sys.argv[4] if len(sys.argv) > 4 else "ddp_fork",
    )
