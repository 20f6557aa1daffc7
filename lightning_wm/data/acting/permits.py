"""How many chunks central acting's env groups may make ahead of the learner, and whose turn it is.

Each chunk made ahead of the learner is made with weights that are older by the time it is used, so
the number of chunks queued or in the making bounds the policy lag. A group takes its own permit
before it starts a chunk (it waits, paused, without one); when the learner takes a group's chunk
that permit is used up and the next group in turn without a permit gets one. With as many permits
as groups every group runs one chunk ahead; with fewer the groups take turns (round robin), so all
their envs keep making rows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["ChunkPermits"]


class ChunkPermits:
    """``permits`` chunks ahead of the learner over ``num_groups`` groups, handed out in turn.

    Args:
        num_groups: env groups; group ``g`` waits on ``semaphores[g]``.
        permits: chunks made ahead of the learner, queued or in the making (at most ``num_groups``
            count: a group makes one chunk at a time).
        semaphore: makes a semaphore whose count starts at 0 (``threading.Semaphore`` or a
            ``multiprocessing`` context's, for groups in processes).
    """

    def __init__(self, num_groups: int, permits: int, semaphore: Callable[[int], Any]) -> None:
        if num_groups < 1 or permits < 1:
            raise ValueError(f"need at least one group and one permit, got {num_groups} and {permits}")
        self.num_groups = num_groups
        self.semaphores = [semaphore(0) for _ in range(num_groups)]
        self._holding: set[int] = set()  # groups with a permit out (their chunk not taken yet)
        self._next = 0
        for _ in range(min(permits, num_groups)):
            self._grant()

    def _grant(self) -> None:
        for i in range(self.num_groups):
            group = (self._next + i) % self.num_groups
            if group not in self._holding:
                self._holding.add(group)
                self._next = (group + 1) % self.num_groups
                self.semaphores[group].release()
                return

    def taken(self, group: int) -> None:
        """The learner took ``group``'s chunk: its permit is used; the next group in turn gets one
        (the learner's thread only)."""
        self._holding.discard(group)
        self._grant()
