"""Every seed of a run derives from the config's one ``seed`` through ``numpy.random.SeedSequence``.

A seed is named by *what it is for*: a ``role`` (``"train"`` envs, ``"eval"`` envs during fit,
``"evaluate"`` for the command, ``"record"``, ``"replay"`` for a buffer's sampler, ``"policy"``
for an agent's own sampling, ...), the DDP ``rank``, the ``actor`` process and, for envs, the
env's index. Distinct names give independent 63-bit seeds (collisions have probability
~2^-63 per pair), however many ranks, actors and envs there are — no hand-picked offsets like
``seed + 1000 * rank`` that collide once a run has more than 1000 envs.
"""

from __future__ import annotations

import zlib

import numpy as np

__all__ = ["derive_seed", "env_seeds", "reset_seeds"]


def _role_key(role: str) -> int:
    return zlib.crc32(role.encode("utf-8"))


def derive_seed(seed: int, role: str = "train", rank: int = 0, actor: int = 0, index: int = 0) -> int:
    """A seed in ``[0, 2**63)`` for ``(role, rank, actor, index)`` under the run's ``seed``.

    Deterministic: the same arguments always give the same seed (usable for
    ``torch.Generator.manual_seed``, ``numpy.random.default_rng`` and gymnasium's ``reset``).
    """
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    sequence = np.random.SeedSequence(entropy=int(seed), spawn_key=(_role_key(role), int(rank), int(actor), int(index)))
    return int(sequence.generate_state(1, dtype=np.uint64)[0] >> np.uint64(1))


def env_seeds(seed: int, num_envs: int, role: str = "train", rank: int = 0, actor: int = 0) -> list[int]:
    """One seed per env of a vector env (for ``VectorEnv.reset(seed=[...])``)."""
    return [derive_seed(seed, role, rank, actor, index=i) for i in range(num_envs)]


def reset_seeds(seed: int | list[int] | tuple[int, ...] | None, num_envs: int) -> list[int | None]:
    """One reset seed per env, as gymnasium's vector envs read ``seed``: a list (one per env), an
    int (env ``i`` gets ``seed + i``) or None (no env is reseeded)."""
    if seed is None:
        return [None] * num_envs
    if isinstance(seed, (list, tuple)):
        if len(seed) != num_envs:
            raise ValueError(f"got {len(seed)} seeds for {num_envs} envs; give one per env")
        return [None if s is None else int(s) for s in seed]
    return [int(seed) + i for i in range(num_envs)]
