"""Dyna and Hybrid world models: imagined rows in the row convention, the buffer-size schedule,
real_ratio in sampled batches, the Imagination callback's cadence."""

from types import SimpleNamespace

import gymnasium as gym
import numpy as np
import pytest
import torch
from torch import nn

from lightning_wm.callbacks import Imagination
from lightning_wm.data.imagination import DynaWorldModel, HybridWorldModel
from lightning_wm.data.modules import ReplayDataModule
from lightning_wm.data.replay import ReplayBuffer
from lightning_wm.data.samplers import RowSampler, SequenceSampler
from lightning_wm.envs import EnvConfig
from lightning_wm.protocols import ImaginationHost
from lightning_wm.world_model import RolloutSchedule, WorldModel

SPACE = gym.spaces.Discrete(2)


class PushModel(nn.Module, WorldModel):
    """Hand-checkable dynamics on [x, y]: action 1 adds 0.5 to x, action 0 subtracts 0.5;
    reward is the new x; the episode terminates (probability 1) once x > 1."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))

    def initial_state(self, obs):
        return obs.float()

    def step(self, state, action, generator=None):
        nxt = state + torch.stack([(action[:, 1] - action[:, 0]) * 0.5, torch.zeros(len(state))], -1) * self.scale
        return nxt[:, 0], nxt, (nxt[:, 0] > 1).float()

    def features(self, state):
        return state

    def decode(self, state):
        return state


class PushAgent:
    """Always pushes right (action 1); extras: logits [B, 2]."""

    def initial_state(self, batch_size):
        return None

    def act(self, obs, state, explore):
        b = obs.shape[0]
        return torch.ones(b, dtype=torch.int64), state, {"logits": torch.tensor([[0.0, 1.0]]).repeat(b, 1)}


def real_buffer(starts):
    """One stream: episodes of 2 rows each, obs [x, 0] with x from ``starts`` on the first row."""
    rows = []
    for x in starts:
        rows.append(
            dict(
                obs=[x, 0.0],
                reward=0.0,
                is_first=True,
                is_last=False,
                is_terminal=False,
                action=1,
                logits=[0.0, 1.0],
                policy_version=3,
            )
        )
        rows.append(
            dict(
                obs=[x + 0.5, 0.0],
                reward=x + 0.5,
                is_first=False,
                is_last=True,
                is_terminal=True,
                action=0,
                logits=[0.0, 0.0],
                policy_version=3,
            )
        )
    chunk = {k: np.array([r[k] for r in rows])[:, None] for k in rows[0]}
    chunk["obs"] = chunk["obs"].astype(np.float32)
    chunk["reward"] = chunk["reward"].astype(np.float32)
    buffer = ReplayBuffer(len(rows), 1, seed=0)
    buffer.add_many(chunk)
    return buffer


def fixed(length):
    return RolloutSchedule(start_step=0, end_step=0, min_length=length, max_length=length)


def stored_rows(buffer):
    """Every stored row of a one-stream buffer, oldest first: {key: [N, ...]}."""
    slots = (buffer.oldest[0] + np.arange(len(buffer))) % buffer.cap_per_stream
    return {k: v.numpy() for k, v in buffer.gather(np.zeros_like(slots), slots).items()}


def split_episodes(rows):
    starts = np.flatnonzero(rows["is_first"])
    return [{k: v[a:b] for k, v in rows.items()} for a, b in zip(starts, [*starts[1:], len(rows["is_first"])])]


def test_imagined_rows_follow_the_row_convention():
    """Starts x = -2 (never terminates in 3 steps), 0 (terminates at step 3), 0.75 (at step 1):
    each imagined episode branches from a real first row, rows after a termination are never
    written, rewards/obs are the model's, actions and extras are zero on last rows."""
    dyna = DynaWorldModel(
        PushModel(), SPACE, rollout_length_scheduler=fixed(3), rollout_batch_size=12, rollout_retain=2, seed=0
    )
    real = real_buffer([-2.0, 0.0, 0.75])
    img = dyna.fill_img_buffer(PushAgent(), real, None, envstep=0, policy_version=7)
    assert img.checkpoint is False and img.capacity == (3 + 1) * 12 * 2 == dyna.buffer_size(0)
    assert set(img.keys) == set(real.keys), "same keys as the real rows (the mixed sampler needs them)"
    rows = stored_rows(img)
    episodes = split_episodes(rows)
    assert len(episodes) == 12 and len(img) == sum(len(e["is_first"]) for e in episodes)
    by_start = {}
    for ep in episodes:
        x0 = float(ep["obs"][0, 0])
        assert x0 in (-2.0, 0.0, 0.75), "starts are real rows that are not last rows"
        by_start[x0] = ep
        assert ep["is_first"][0] and not ep["is_first"][1:].any()
        assert ep["reward"][0] == 0 and ep["is_last"][-1] and not ep["is_last"][:-1].any()
        assert not ep["is_terminal"][:-1].any(), "nothing after a termination"
        np.testing.assert_allclose(ep["obs"][1:, 0], x0 + 0.5 * np.arange(1, len(ep["obs"])))
        np.testing.assert_allclose(ep["reward"][1:], ep["obs"][1:, 0])
        assert (ep["action"][:-1] == 1).all() and ep["action"][-1] == 0
        assert (ep["logits"][:-1] == [0, 1]).all() and (ep["logits"][-1] == 0).all()
        assert (ep["policy_version"] == 7).all()
    assert len(by_start[-2.0]["obs"]) == 4 and not by_start[-2.0]["is_terminal"].any(), "truncated at the length"
    assert len(by_start[0.0]["obs"]) == 4 and by_start[0.0]["is_terminal"][-1]
    assert len(by_start[0.75]["obs"]) == 2 and by_start[0.75]["is_terminal"][-1]
    assert all(p.grad is None for p in dyna.model.parameters())


def test_buffer_keeps_rollout_retain_fills_and_follows_the_length_schedule():
    schedule = RolloutSchedule(start_step=0, end_step=100, min_length=0, max_length=4)
    dyna = DynaWorldModel(
        PushModel(), SPACE, rollout_length_scheduler=schedule, rollout_batch_size=5, rollout_retain=2, seed=0
    )
    real = real_buffer([-5.0])  # never terminates: every episode has length + 1 rows
    assert dyna.fill_img_buffer(PushAgent(), real, None, envstep=0) is None, "length 0: nothing imagined"
    img = dyna.fill_img_buffer(PushAgent(), real, None, envstep=50)  # length 2
    assert len(img) == 3 * 5
    for _ in range(3):
        img = dyna.fill_img_buffer(PushAgent(), real, img, envstep=50)
    assert len(img) == 2 * 3 * 5, "rollout_retain fills kept"
    bigger = dyna.fill_img_buffer(PushAgent(), real, img, envstep=100)  # length 4: a larger buffer
    assert bigger is not img and bigger.capacity == 2 * 5 * 5 and len(bigger) == 5 * 5


def test_real_ratio_holds_in_datamodule_batches():
    dm = ReplayDataModule(
        EnvConfig("CartPole-v1", num_envs=1), batch_size=20, prefill=0, sampler=RowSampler(), replay={"capacity": 64}
    )
    assert isinstance(dm, ImaginationHost)
    dm.buffer = real_buffer([-2.0, 0.0, 0.75, 1.0])
    assert "is_real" not in dm.sample_batch()
    dyna = DynaWorldModel(
        PushModel(), SPACE, rollout_length_scheduler=fixed(2), real_ratio=0.25, rollout_batch_size=8, seed=0
    )
    dm.set_imagination(None, dyna.real_ratio)
    assert dm.sample_batch()["is_real"].all(), "all real while there is no imagination"
    img = dyna.fill_img_buffer(PushAgent(), dm.real_buffer(), None, envstep=0, policy_version=5)
    dm.set_imagination(img, dyna.real_ratio)
    assert dm.replay_buffers()["imagination"] is img
    for _ in range(5):
        batch = dm.sample_batch()
        assert batch["is_real"].sum() == 5 and len(batch["is_real"]) == 20
        assert (batch["policy_version"][batch["is_real"]] == 3).all(), "real items come from the real buffer"
        assert (batch["policy_version"][~batch["is_real"]] == 5).all(), "the rest from the imagination"


def test_dyna_sample_mixes_sequences_at_real_ratio():
    dyna = DynaWorldModel(
        PushModel(), SPACE, rollout_length_scheduler=fixed(3), real_ratio=0.5, rollout_batch_size=4, seed=0
    )
    real = real_buffer([-2.0, -1.0, 0.0])
    img = dyna.fill_img_buffer(PushAgent(), real, None, envstep=0)
    batch = dyna.sample(real, img, 8, SequenceSampler(2))
    assert batch["obs"].shape == (8, 2, 2) and batch["is_real"].tolist() == [True] * 4 + [False] * 4


def test_imagination_callback_fills_every_train_freq_env_steps():
    dyna = DynaWorldModel(
        PushModel(), SPACE, train_freq=100, rollout_length_scheduler=fixed(1), rollout_batch_size=3, seed=0
    )
    dm = ReplayDataModule(
        EnvConfig("CartPole-v1", num_envs=1), batch_size=4, prefill=0, sampler=RowSampler(), replay={"capacity": 64}
    )
    dm.buffer = real_buffer([0.0])
    agent = PushAgent()
    module = SimpleNamespace(
        dyna=dyna, env_steps=0, act=agent.act, initial_state=agent.initial_state, log=lambda *a, **k: None
    )
    trainer = SimpleNamespace(datamodule=dm, global_step=0)
    callback = Imagination()
    fills = []
    for steps in (50, 99, 100, 150, 199, 200, 260):
        module.env_steps = steps
        callback.on_train_batch_end(trainer, module, None, None, 0)
        fills.append(dyna.fills)
    assert fills == [0, 0, 1, 1, 1, 2, 2]
    assert dm.imagination is not None and len(dm.imagination) == 2 * 3 * 2
    assert dyna.should_eval(300) and dyna.last_train_step == 200


def test_hybrid_world_model_does_both():
    hybrid = HybridWorldModel(PushModel(), SPACE, rollout_length_scheduler=fixed(2), rollout_batch_size=4, seed=0)
    actor = nn.Linear(2, 2)
    out = hybrid.rollout(torch.zeros(3, 2), lambda f: torch.softmax(actor(f), -1), envstep=0)
    assert out["rewards"].shape == (2, 3) and out["actions"].shape == (3, 3, 2)
    out["rewards"].sum().backward()
    assert actor.weight.grad is not None and hybrid.model.scale.grad is None
    img = hybrid.fill_img_buffer(PushAgent(), real_buffer([-2.0]), None, envstep=0)
    assert len(img) == 4 * 3
    assert hybrid.sample(real_buffer([-2.0]), img, 10)["is_real"].sum() == round(0.05 * 10)


class CountModel(PushModel):
    """PushModel whose filtered state counts the real rows read since the episode began (in y)."""

    def zero_state(self, batch_size, device=None):
        return torch.zeros(batch_size, 2)

    def observe_step(self, state, action, obs, is_first=None):
        count = torch.where(is_first, torch.zeros(len(obs)), state[:, 1] + 1)
        return torch.stack([obs[:, 0].float(), count], -1)


def test_burn_in_starts_from_the_filtered_state():
    """One real episode of 6 rows; burn_in 2 filters the 2 rows before each start (never an
    is_last row), so the state there has read 2 more rows: the imagined obs carry y = 2."""
    x = np.arange(6, dtype=np.float32) * 0.1 - 3
    chunk = {
        "obs": np.stack([x, np.zeros(6, np.float32)], -1)[:, None],
        "reward": np.zeros((6, 1), np.float32),
        "is_first": (np.arange(6) == 0)[:, None],
        "is_last": (np.arange(6) == 5)[:, None],
        "is_terminal": (np.arange(6) == 5)[:, None],
        "action": np.ones((6, 1), np.int64),
        "logits": np.zeros((6, 1, 2), np.float32),
    }
    real = ReplayBuffer(6, 1, seed=0)
    real.add_many(chunk)
    dyna = DynaWorldModel(
        CountModel(), SPACE, rollout_length_scheduler=fixed(1), rollout_batch_size=16, burn_in=2, seed=0
    )
    episodes = split_episodes(stored_rows(dyna.fill_img_buffer(PushAgent(), real, None, envstep=0)))
    starts = {round(float(ep["obs"][0, 0]), 3) for ep in episodes}
    assert starts <= {round(float(v), 3) for v in x[2:5]}, "starts have 2 rows before them and are not last rows"
    assert all(ep["obs"][0, 1] == 0 and ep["obs"][1, 1] == 2 for ep in episodes)


def test_bad_options_say_what_is_wrong():
    with pytest.raises(ValueError, match="real_ratio"):
        DynaWorldModel(PushModel(), SPACE, real_ratio=1.5)
    with pytest.raises(ValueError, match="rollout_batch_size"):
        DynaWorldModel(PushModel(), SPACE, rollout_batch_size=0)


class DoneModel(PushModel):
    """PushModel whose done head says 0.3 everywhere."""

    def step(self, state, action, generator=None):
        reward, nxt, _ = super().step(state, action, generator)
        return reward, nxt, torch.full_like(reward, 0.3)


def test_sampled_terminations_follow_the_done_probability():
    """terminal_mode sample: an imagined step ends with the done head's probability (0.3 here, so
    episode lengths are geometric), where the threshold 0.5 never ends one; the draws follow the
    seed."""

    def lengths(mode, seed):
        dyna = DynaWorldModel(
            DoneModel(),
            SPACE,
            rollout_length_scheduler=fixed(4),
            rollout_batch_size=4000,
            rollout_retain=1,
            seed=seed,
            terminal_mode=mode,
        )
        episodes = split_episodes(stored_rows(dyna.fill_img_buffer(PushAgent(), real_buffer([-9.0]), None, 0)))
        return np.array([len(e["is_first"]) - 1 for e in episodes]), np.array([e["is_terminal"][-1] for e in episodes])

    steps, terminal = lengths("threshold", 0)
    assert (steps == 4).all() and not terminal.any()
    steps, terminal = lengths("sample", 0)
    # P(ends at step k) = 0.7^(k-1) 0.3 for k <= 4; truncated at 4 otherwise
    for k in (1, 2, 3):
        assert np.mean((steps == k) & terminal) == pytest.approx(0.7 ** (k - 1) * 0.3, abs=0.025)
    assert np.mean(~terminal) == pytest.approx(0.7**4, abs=0.025)
    assert np.array_equal(lengths("sample", 0)[0], steps) and not np.array_equal(lengths("sample", 1)[0], steps)
    with pytest.raises(ValueError, match="terminal_mode must be 'threshold' or 'sample'"):
        DynaWorldModel(PushModel(), SPACE, terminal_mode="bernoulli")
