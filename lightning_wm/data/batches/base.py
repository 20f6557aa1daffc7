"""What the datamodule asks of its batch side (:class:`BatchSide`)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from lightning_wm.data.acting.base import Acting
from lightning_wm.data.replay import ReplayBuffer

__all__ = ["BatchSide"]


class BatchSide(ABC):
    """How an online datamodule turns rows into batches. The datamodule calls :meth:`setup` once
    with its acting part, :meth:`use_agent` whenever an agent is attached, :meth:`next_batch`
    for every training batch, and hands the learner's feedback and the imagination on."""

    imagination: ReplayBuffer | None = None  # imagined rows mixed into the batches (Dyna)

    @abstractmethod
    def setup(self, acting: Acting, rank: int, seed: int) -> None:
        """Build the buffers (``seed``: their sampling RNG, this rank's ``replay`` seed)."""

    def use_agent(self, agent: Any) -> None:  # noqa: B027 - optional: what a batch side takes from the agent
        """Take what the batch side needs from the agent acted with (e.g. its sampler)."""

    @property
    def rows(self) -> ReplayBuffer | None:
        """The buffer every row acted in this process also goes to (``None``: none)."""
        return None

    def random_rows(self) -> int:
        """Rows the random prefill still owes."""
        return 0

    @abstractmethod
    def next_batch(self) -> dict[str, Any]:
        """Make (or take) the rows of one batch and return the batch."""

    @abstractmethod
    def apply_feedback(self, batch: dict[str, Any], feedback: dict[str, Any]) -> dict[str, int]:
        """Write the learner's feedback on ``batch`` back; ``{"applied", "stale"}`` row counts."""

    @abstractmethod
    def real_buffer(self) -> ReplayBuffer:
        """The real rows imagined rollouts start from."""

    @abstractmethod
    def set_imagination(self, buffer: ReplayBuffer | None, real_ratio: float) -> None:
        """Mix items of ``buffer`` (imagined rows) into the batches at ``real_ratio``."""

    @abstractmethod
    def replay_buffers(self) -> dict[str, ReplayBuffer]:
        """The buffers held, by name."""

    def close(self) -> None:  # noqa: B027 - optional: what to forget when acting stops
        """The acting part stopped (its sources' pending rows are lost)."""

    def state_dict(self, global_step: int) -> dict[str, Any]:
        """Progress a checkpoint keeps (merged into the datamodule's state: keys must be unique)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:  # noqa: B027 - optional: nothing kept by default
        """Restore :meth:`state_dict` (keys it does not know are ignored)."""
