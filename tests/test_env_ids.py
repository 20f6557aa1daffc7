"""Where ``lightning_wm/Dream-v0`` is registered: by ``lightning_wm.env_ids`` when the package is
imported, with string entry points, so any process that makes envs (a spawned actor or env worker)
finds it without importing the Dreamer package first, and ``envs.py`` names no agent."""

import multiprocessing
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import pytorch_lightning as pl
import torch

from lightning_wm.env_ids import DREAM_ENV_ID
from lightning_wm.envs import EnvConfig, env_spec

from support.presets import DREAMER_TINY

ROOT = Path(__file__).resolve().parents[1]


def test_dream_id_is_registered_with_string_entry_points():
    spec = gym.spec(DREAM_ENV_ID)
    assert spec.entry_point == "lightning_wm.agents.dreamer.dream:make_dream_env"
    assert spec.vector_entry_point == "lightning_wm.agents.dreamer.dream:make_dream_vector_env"
    assert "agents" not in (ROOT / "lightning_wm/envs.py").read_text()  # the factory names no agent


@pytest.mark.slow
def test_importing_the_env_factory_registers_the_id_without_an_agent():
    code = (
        "import sys, gymnasium as gym, lightning_wm.envs as envs\n"
        "assert envs.DREAM_ENV_ID in gym.registry\n"
        "assert not [m for m in sys.modules if m.startswith('lightning_wm.agents')], 'an agent was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


@pytest.fixture(scope="module")
def dream_files(tmp_path_factory):
    """A tiny (untrained) Dreamer checkpoint of CartPole-v1 and a store of one recorded episode."""
    from lightning_wm.agents.dreamer import Dreamer
    from lightning_wm.data.episodes import EpisodeStore

    root = tmp_path_factory.mktemp("dream_id")
    torch.manual_seed(0)
    dreamer = Dreamer(env_spec(EnvConfig(id="CartPole-v1")), **DREAMER_TINY)
    ckpt = root / "dreamer.ckpt"
    state = {"state_dict": dreamer.state_dict(), "hyper_parameters": dict(dreamer.hparams)}
    torch.save({**state, "pytorch-lightning_version": pl.__version__}, ckpt)
    length = 5
    flags = np.zeros(length, bool)
    EpisodeStore(root / "episodes").add(
        {
            "obs": np.random.default_rng(0).normal(size=(length, 4)).astype(np.float32),
            "action": np.zeros(length, np.int64),
            "reward": np.ones(length, np.float32),
            "is_first": np.r_[True, flags[1:]],
            "is_last": np.r_[flags[:-1], True],
            "is_terminal": np.r_[flags[:-1], True],
        }
    )
    return {"dreamer_ckpt": str(ckpt), "episodes": str(root / "episodes"), "max_episode_steps": 7}


@pytest.mark.slow
def test_a_spawned_process_makes_a_dream_without_importing_dreamer_first(dream_files):
    from support.dream_child import make_dream_here

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        out = pool.submit(make_dream_here, dream_files).result(timeout=300)
    assert out["dreamer_before"] is False  # nothing of the agent was imported before the env was made
    assert out["dreamer_after"] is True  # the string entry point loaded it
    assert out["single"] == (4,) and out["vector"] == (2, 4)  # CartPole's observations, decoded
