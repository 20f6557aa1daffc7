"""Tiny MuZero modules and filled replay datamodules for the MuZero tests (a helper module, not a
test module)."""

from __future__ import annotations

from lightning_wm.agents.muzero import MuZero, MuZeroNet
from lightning_wm.data.modules import ReplayDataModule
from lightning_wm.data.samplers import WindowSampler
from lightning_wm.envs import EnvConfig, EnvSpec, env_spec
from lightning_wm.optim import OptimSettings
from lightning_wm.search import SearchSettings

from support.presets import MUZERO_TINY

NET = MuZeroNet(**MUZERO_TINY["net"])


def small(net: MuZeroNet = NET, search: SearchSettings | None = None, **groups) -> MuZero:
    """A tiny MuZero on CartPole: ``NET``, ``MUZERO_TINY``'s search, Adam at 1e-3, and the groups given."""
    search = search or SearchSettings(**MUZERO_TINY["search"])
    groups.setdefault("optim", OptimSettings(lr=1e-3))
    return MuZero(cartpole_spec(), net=net, search=search, **groups)


def cartpole_spec() -> EnvSpec:
    return env_spec(EnvConfig("CartPole-v1"))


def filled_datamodule(
    model: MuZero,
    rows: int = 120,
    num_envs: int = 2,
    capacity: int = 1000,
    sampler: WindowSampler | None = None,
    prioritized: bool = False,
) -> ReplayDataModule:
    """A datamodule whose buffer holds ``rows`` rows per env acted by ``model`` (no prefill)."""
    dm = ReplayDataModule(
        EnvConfig("CartPole-v1", num_envs=num_envs, seed=3),
        batch_size=8,
        sampler=sampler or model.replay_sampler(),
        prefill=0,
        replay={"capacity": capacity, "prioritized": prioritized},
    )
    dm.setup("fit")
    dm.collector.set_agent(model)
    dm.collector.collect(rows)
    return dm


def quiet(model: MuZero) -> MuZero:
    model.log = lambda *args, **kwargs: None  # training_step outside a Trainer
    return model
