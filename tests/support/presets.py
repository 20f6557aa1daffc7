"""Tiny sizes for every family, in one place: as Python keyword groups and as CLI overrides.

Python tests pass the groups to the constructors (``Dreamer(spec, **DREAMER_TINY)``, a group's
fields merged over with ``{**DREAMER_TINY["net"], "bins": 15}``); CLI tests shrink a shipped config
with ``model_overrides(DREAMER_TINY)`` and ``data_overrides(REPLAY_DATA_TINY)``. A test that needs
another size keeps its own value next to the preset and says why.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

# -- model groups, per family -------------------------------------------------------------------------

#: Dreamer: a 16-unit RSSM with 4x4 latents, 31 two-hot bins, a 4-channel CNN, horizon 4.
DREAMER_TINY: dict[str, dict[str, Any]] = {
    "net": {"deter": 16, "stoch": 4, "classes": 4, "hidden": 16, "layers": 1, "bins": 31, "cnn_depth": 4},
    "behavior": {"horizon": 4},
}

#: MuZero: 16-unit latent and trunks, a 21-bin support, 4 simulations per search.
MUZERO_TINY: dict[str, dict[str, Any]] = {
    "net": {"latent_dim": 16, "hidden": 16, "layers": 1, "head_hidden": 8, "support_size": 10},
    "search": {"num_simulations": 4},
}

#: IMPALA: a 16-unit actor-critic MLP.
IMPALA_TINY: dict[str, dict[str, Any]] = {"net": {"hidden": 16}}

#: World Models V: a 4-dim latent from a 4-channel encoder (keyword arguments of ``Vision``).
VISION_TINY: dict[str, Any] = {"latent_dim": 4, "depth": 4}

#: World Models M: an 8-unit LSTM over the 4-dim latent of ``VISION_TINY``, 2 Gaussians.
MEMORY_TINY: dict[str, dict[str, Any]] = {"net": {"latent_dim": 4, "hidden": 8, "num_mixtures": 2}}

# -- data groups: a few rows, small batches, one evaluation episode -----------------------------------

#: A replay datamodule (Dreamer's and the TinyAgent's SequenceSampler) shrunk for seconds-long fits.
REPLAY_DATA_TINY: dict[str, Any] = {
    "prefill": 64,
    "batch_size": 4,
    "sampler": {"init_args": {"length": 8}},
    "eval": {"episodes": 1, "envs": 1},
}

#: MuZero's replay datamodule shrunk (its WindowSampler follows the model's unroll settings).
MUZERO_DATA_TINY: dict[str, Any] = {
    "batch_size": 8,
    "prefill": 40,
    "env": {"num_envs": 2},
    "eval": {"episodes": 1, "envs": 1},
}

#: An unroll datamodule (IMPALA, Dyna) shrunk: 2 envs, 4-step unrolls, 30-step episodes.
UNROLL_DATA_TINY: dict[str, Any] = {
    "env": {"num_envs": 2, "max_episode_steps": 30},
    "unroll_length": 4,
    "batch_size": 2,
    "eval": {"episodes": 1, "envs": 1},
}

# -- nested groups as command-line options ------------------------------------------------------------


def overrides(groups: Mapping[str, Any], prefix: str) -> list[str]:
    """Nested groups as dotted command-line options under ``prefix``, in the order given:
    ``overrides({"net": {"deter": 16}}, "--model.init_args") == ["--model.init_args.net.deter", "16"]``.
    Values are written as YAML reads them back (``true``, ``null``, ``[1, 2]``)."""
    args: list[str] = []
    for key, value in groups.items():
        option = f"{prefix}.{key}"
        if isinstance(value, Mapping):
            args += overrides(value, option)
        else:
            args += [option, _as_yaml(value)]
    return args


def model_overrides(groups: Mapping[str, Any]) -> list[str]:
    """``--model.init_args.<group>.<field> <value>`` for every field of ``groups``."""
    return overrides(groups, "--model.init_args")


def data_overrides(groups: Mapping[str, Any]) -> list[str]:
    """``--data.init_args.<group>.<field> <value>`` for every field of ``groups``."""
    return overrides(groups, "--data.init_args")


def merged(base: Mapping[str, Any], changes: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``changes`` merged in, group by group (nested dicts merge, other values replace)."""
    out = dict(base)
    for key, value in changes.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merged(out[key], value)
        else:
            out[key] = value
    return out


def _as_yaml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (list, tuple)):
        return json.dumps(list(value))
    return str(value)


# -- the TinyAgent (tests of the foundation) from the command line -------------------------------------

#: The TinyAgent on a replay datamodule over CartPole: the options every TinyAgent fit shares
#: (``--data`` names its class, so its options need no ``init_args``).
TINY_AGENT = [
    "--model",
    "support.tiny_agent.TinyAgent",
    "--data",
    "lightning_wm.data.modules.ReplayDataModule",
    "--data.env.id",
    "CartPole-v1",
    "--data.sampler",
    "SequenceSampler",
    *overrides({key: REPLAY_DATA_TINY[key] for key in ("prefill", "batch_size", "sampler")}, "--data"),
]

#: A TinyAgent fit in process: 2 envs, replay ratio 0.5, 2 evaluation episodes, run folder ``tiny``.
TINY_FIT = [
    *TINY_AGENT,
    "--data.env.num_envs",
    "2",
    "--data.replay_ratio",
    "0.5",
    "--data.eval.episodes",
    "2",
    "--trainer.accelerator",
    "cpu",
    "--trainer.enable_progress_bar",
    "false",
    "--trainer.log_every_n_steps",
    "5",
    "--trainer.run_name",
    "tiny",
]
