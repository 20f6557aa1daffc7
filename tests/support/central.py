"""Central acting in tests: an acting part set up as rank 0, and chunks taken as the batch side takes them."""

from __future__ import annotations

from lightning_wm.data.acting import PoolActing
from lightning_wm.data.settings import ActingSettings
from lightning_wm.envs import EnvConfig


def central_acting(env: EnvConfig, groups: int, envs: int, chunk: int, **settings) -> PoolActing:
    """``groups`` env groups of ``envs`` envs, chunks of ``chunk`` steps; ``settings``: more of the acting group."""
    acting = PoolActing(
        env, ActingSettings(num_actors=groups, envs_per_actor=envs, policy="central", **settings), chunk
    )
    acting.setup(rank=0)
    return acting


def take_chunks(acting: PoolActing, count: int) -> list:
    """The next ``count`` chunks (each within 60 s), each marked received."""
    out = []
    while len(out) < count:
        chunk = acting.next_chunk(timeout=60)
        assert chunk is not None
        acting.received(chunk)
        out.append(chunk)
    return out
