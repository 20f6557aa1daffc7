"""Dyna and Hybrid world models: imagined rows in the row convention, the buffer-size schedule,
real_ratio in sampled batches, the model's evaluation on real rows, the Imagination callback's
cadence."""

from types import SimpleNamespace

import gymnasium as gym
import numpy as np
import pytest
import torch
from torch import nn

from lightning_wm.agents.dyna import DynaWorldModel, HybridWorldModel, Imagination, ImaginationSettings
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
        PushModel(), SPACE, ImaginationSettings(rollout_batch_size=12, rollout_retain=2), fixed(3), seed=0
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
        PushModel(), SPACE, ImaginationSettings(rollout_batch_size=5, rollout_retain=2), schedule, seed=0
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
        PushModel(), SPACE, ImaginationSettings(real_ratio=0.25, rollout_batch_size=8), fixed(2), seed=0
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
        PushModel(), SPACE, ImaginationSettings(real_ratio=0.5, rollout_batch_size=4), fixed(3), seed=0
    )
    real = real_buffer([-2.0, -1.0, 0.0])
    img = dyna.fill_img_buffer(PushAgent(), real, None, envstep=0)
    batch = dyna.sample(real, img, 8, SequenceSampler(2))
    assert batch["obs"].shape == (8, 2, 2) and batch["is_real"].tolist() == [True] * 4 + [False] * 4


def test_imagination_callback_fills_every_train_freq_env_steps():
    dyna = DynaWorldModel(
        PushModel(), SPACE, ImaginationSettings(rollout_batch_size=3), fixed(1), train_freq=100, seed=0
    )
    dm = ReplayDataModule(
        EnvConfig("CartPole-v1", num_envs=1), batch_size=4, prefill=0, sampler=RowSampler(), replay={"capacity": 64}
    )
    dm.buffer = real_buffer([0.0])
    agent = PushAgent()
    logged = {}
    module = SimpleNamespace(
        dyna=dyna,
        env_steps=0,
        act=agent.act,
        initial_state=agent.initial_state,
        log=lambda name, value, **k: logged.setdefault(name, []).append((module.env_steps, value)),
    )
    trainer = SimpleNamespace(datamodule=dm, global_step=0)
    callback = Imagination()
    fills = []
    for steps in (50, 99, 100, 150, 199, 200, 260, 300):
        module.env_steps = steps
        callback.on_train_batch_end(trainer, module, None, None, 0)
        fills.append(dyna.fills)
    assert fills == [0, 0, 1, 1, 1, 2, 2, 3]
    assert dm.imagination is not None and len(dm.imagination) == 3 * 3 * 2, "3 fills of 3 rollouts of 2 rows"
    assert dyna.last_train_step == 300
    # evaluated every eval_freq (250) env steps, once the model was trained
    assert [step for step, _ in logged["world_model/eval_reward_mse"]] == [260] and dyna.last_eval_step == 260


def test_hybrid_world_model_does_both():
    hybrid = HybridWorldModel(PushModel(), SPACE, ImaginationSettings(rollout_batch_size=4), fixed(2), seed=0)
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
    dyna = DynaWorldModel(CountModel(), SPACE, ImaginationSettings(rollout_batch_size=16, burn_in=2), fixed(1), seed=0)
    episodes = split_episodes(stored_rows(dyna.fill_img_buffer(PushAgent(), real, None, envstep=0)))
    starts = {round(float(ep["obs"][0, 0]), 3) for ep in episodes}
    assert starts <= {round(float(v), 3) for v in x[2:5]}, "starts have 2 rows before them and are not last rows"
    assert all(ep["obs"][0, 1] == 0 and ep["obs"][1, 1] == 2 for ep in episodes)


def test_bad_options_say_what_is_wrong():
    for kwargs, match in (
        ({"real_ratio": 1.5}, "imagination.real_ratio must be in"),
        ({"rollout_batch_size": 0}, "rollout_batch_size"),
        ({"burn_in": -1}, "imagination.burn_in"),
        ({"terminal_threshold": 2.0}, "imagination.terminal_threshold"),
    ):
        with pytest.raises(ValueError, match=match):
            ImaginationSettings(**kwargs)


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
            ImaginationSettings(rollout_batch_size=4000, rollout_retain=1, terminal_mode=mode),
            fixed(4),
            seed=seed,
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
        ImaginationSettings(terminal_mode="bernoulli")


class OffModel(PushModel):
    """PushModel whose reward is 1 too high and whose done head says 0.5 everywhere."""

    def step(self, state, action, generator=None):
        reward, nxt, _ = super().step(state, action, generator)
        return reward + 1.0, nxt, torch.full_like(reward, 0.5)


def test_evaluate_measures_one_step_errors_on_the_newest_real_rows():
    """Episodes [x, x + 0.5] from x = -2, 0, 0.75: the model's one step from each first row is
    compared with the real second row (the last rows start no transition). Evaluating draws
    nothing from the buffer and leaves the global RNG as it was."""
    real = real_buffer([-2.0, 0.0, 0.75])
    exact = DynaWorldModel(PushModel(), SPACE, ImaginationSettings(rollout_batch_size=16), fixed(1), seed=0)
    out = exact.evaluate(real)
    assert out["world_model/eval_rows"] == 3
    assert out["world_model/eval_reward_mse"] == 0 and out["world_model/eval_obs_mse"] == 0
    # done is 1 only from x = 0.75 (every real second row is terminal): two of three miss it
    assert out["world_model/eval_termination_bce"] == pytest.approx(2 / 3 * -np.log(1e-6), rel=1e-4)
    rng, twin = torch.get_rng_state(), real_buffer([-2.0, 0.0, 0.75])
    off = DynaWorldModel(OffModel(), SPACE, ImaginationSettings(rollout_batch_size=2), fixed(1), seed=0).evaluate(real)
    assert torch.equal(torch.get_rng_state(), rng)
    assert off["world_model/eval_rows"] == 2, "at most rollout_batch_size rows"
    assert off["world_model/eval_reward_mse"] == pytest.approx(1.0)
    assert off["world_model/eval_termination_bce"] == pytest.approx(np.log(2.0), rel=1e-5)
    assert np.array_equal(real.draw(5)[1], twin.draw(5)[1]), "the buffer's draws are untouched"
    assert exact.evaluate(ReplayBuffer(4, 1, seed=0)) == {}, "nothing to evaluate on yet"
