"""Central inference in a process of its own (``acting.central_groups: processes``) and the publish
path it shares with policy copies (``acting_weights``: an acting copy's ``state_dict`` read from the
live tensors): the settings, the weights each family publishes, rows acted by the published
weights and carrying their version, no policy call in the learner, and an error, a hang or
``kill -9`` of the inference process becoming one error naming it, with nothing left behind.
``test_central.py`` runs the CLI fits and ``kill -9`` of the learner in this mode too."""

import os
import signal

import numpy as np
import pytest
import torch

from lightning_wm.agents.dreamer import Dreamer
from lightning_wm.agents.dyna import DynaLearner
from lightning_wm.agents.impala import IMPALA
from lightning_wm.data.acting import ActorError
from lightning_wm.data.settings import ActingSettings
from lightning_wm.envs import EnvConfig, env_spec
from lightning_wm.protocols import acting_weights
from lightning_wm.search import SearchSettings, TemperatureSchedule

from support.actor_agents import FaultyPolicy, MarkedPolicy
from support.central import central_acting, take_chunks
from support.muzero_helpers import small
from support.presets import DREAMER_TINY, IMPALA_TINY, MUZERO_TINY
from support.processes import alive, wait_gone


# -- settings and the weights a publish sends ------------------------------------------------------
def test_settings_refuse_the_inference_process_beside_group_threads_and_a_thread_beside_processes():
    with pytest.raises(ValueError, match="acting.central_inference must be 'thread' or 'process'"):
        ActingSettings(policy="central", central_inference="gpu")
    with pytest.raises(ValueError, match="set acting.central_groups: processes"):
        ActingSettings(num_actors=2, policy="central", central_inference="process")
    with pytest.raises(ValueError, match="was removed .* use central_groups: processes alone"):
        ActingSettings(num_actors=2, policy="central", central_groups="processes", central_inference="thread")
    ActingSettings(num_actors=2, policy="central", central_groups="processes", central_inference="process")
    ActingSettings(num_actors=2, policy="central", central_groups="threads", central_inference="thread")


def _same_weights(agent) -> None:
    published, copied = acting_weights(agent), agent.acting_copy().state_dict()
    assert list(published) == list(copied)
    for key, value in copied.items():
        torch.testing.assert_close(published[key], value, msg=key)


def test_each_family_publishes_its_acting_copys_state_dict_without_copying_the_module():
    spec = env_spec(EnvConfig("CartPole-v1"))
    impala = IMPALA(spec, net=IMPALA_TINY["net"])
    _same_weights(impala)
    key, live = next(iter(impala.net.state_dict().items()))
    assert acting_weights(impala)[key].data_ptr() == live.data_ptr(), "the live tensors, not a copy"
    schedule = TemperatureSchedule((10,), (1.0, 0.25))
    muzero = small(search=SearchSettings(**MUZERO_TINY["search"], temperature=schedule))
    _same_weights(muzero)
    assert float(acting_weights(muzero)["temperature"]) == 1.0
    dreamer = Dreamer(spec, **DREAMER_TINY)
    _same_weights(DynaLearner(spec, policy=lambda s: IMPALA(s, net=IMPALA_TINY["net"]), world_model=lambda s: dreamer))
    _same_weights(dreamer)
    key, live = next(iter(dreamer.actor.state_dict().items()))
    assert acting_weights(dreamer)[f"actor.{key}"].data_ptr() == live.data_ptr(), "the live tensors, not a copy"


# -- the inference process -------------------------------------------------------------------------
def _process_acting(groups: int = 2, envs: int = 2, chunk: int = 4, **settings):
    return central_acting(
        EnvConfig("CartPole-v1"),
        groups,
        envs,
        chunk,
        central_groups="processes",
        **settings,
    )


def _marked(value: float) -> MarkedPolicy:
    policy = MarkedPolicy()
    with torch.no_grad():
        policy.w.fill_(value)
    return policy


@pytest.mark.slow
def test_rows_are_acted_by_the_published_weights_in_another_process_and_carry_their_version():
    acting = _process_acting(publish_every=2)
    learner = _marked(1.0)
    try:
        acting.attach_agent(learner, version=3)
        pids = acting.pool.pids()
        assert len(pids) == 3 and os.getpid() not in pids and all(alive(p) for p in pids)
        first = take_chunks(acting, 4)
        for chunk in first:
            acted = ~chunk.rows["is_last"]  # an episode's last row is not acted (no extras)
            assert (chunk.rows["mark"][acted] == 1.0).all() and (chunk.rows["policy_version"] == 3).all()
        with torch.no_grad():
            learner.w.fill_(2.0)
        acting.attach_agent(learner, version=4)  # fewer than publish_every steps since version 3: not sent
        with torch.no_grad():
            learner.w.fill_(5.0)
        acting.attach_agent(learner, version=5)
        assert acting.published == 5
        later = take_chunks(acting, 12)
        calls, requests = acting.pool.slots.served.tolist()
        assert requests >= 16 * 4 and calls <= requests, "counted in the inference process"
    finally:
        acting.close()
    assert wait_gone(pids, 30) == []
    for chunk in later:
        acted = ~chunk.rows["is_last"]
        mark, version = chunk.rows["mark"][acted], chunk.rows["policy_version"][acted]
        assert set(np.unique(mark).tolist()) <= {1.0, 5.0}, "version 4 was never published"
        assert ((mark == 1.0) == (version == 3)).all() and ((mark == 5.0) == (version == 5)).all()
    assert (later[-1].rows["mark"][~later[-1].rows["is_last"]] == 5.0).all(), (
        "the inference process took the new weights"
    )
    assert acting.pool is None


@pytest.mark.slow
def test_an_error_a_hang_or_kill_9_of_the_inference_process_becomes_one_error_naming_it():
    acting = _process_acting()
    try:
        acting.attach_agent(FaultyPolicy("raise", at=6), version=0)
        with pytest.raises(ActorError, match=r"central inference process \(pid \d+\) raised:(.|\n)*policy exploded"):
            take_chunks(acting, 50)
    finally:
        acting.close()
    acting = _process_acting(timeout_s=1.0)
    try:
        acting.attach_agent(FaultyPolicy("hang", at=4), version=0)
        pids = acting.pool.pids()
        with pytest.raises(ActorError, match=r"central inference process \(pid \d+\) hung: no heartbeat"):
            take_chunks(acting, 50)
    finally:
        acting.close()
    assert wait_gone(pids, 30) == []
    acting = _process_acting()
    try:
        acting.attach_agent(_marked(1.0), version=0)
        take_chunks(acting, 2)
        pids = acting.pool.pids()
        os.kill(pids[-1], signal.SIGKILL)
        with pytest.raises(ActorError, match=r"central inference process \(pid \d+\) was killed by signal SIGKILL"):
            take_chunks(acting, 1000)
    finally:
        acting.close()
    assert wait_gone(pids, 30) == [], "the groups stopped with the inference process gone"
