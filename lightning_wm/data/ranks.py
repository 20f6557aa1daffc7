"""The DDP rank of a datamodule: every rank acts in its own envs and keeps its own buffers."""

from __future__ import annotations

from typing import Any

__all__ = ["rank_and_world"]


def rank_and_world(datamodule: Any) -> tuple[int, int]:
    """The DDP rank and world size of ``datamodule``'s trainer (``(0, 1)`` without one)."""
    trainer = getattr(datamodule, "trainer", None)
    if trainer is None:
        return 0, 1
    return trainer.global_rank, trainer.world_size
