""":class:`OnlineDataModule`: the one lifecycle of every datamodule that learns from acting.

An online datamodule is an **acting part** (:mod:`lightning_wm.data.acting`: how rows are made —
in the learner's process or by actors) plus a **batch part** (:mod:`lightning_wm.data.batches`:
how rows become batches — replay or unrolls). This base class owns what both share: setting
them up and stopping them, attaching the agent, the env-step count, the training stream, the
evaluation episodes, the learner's feedback, the imagination and the checkpoint state.
:mod:`lightning_wm.data.modules` has the two public classes.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytorch_lightning as pl
from pytorch_lightning.utilities.model_helpers import is_overridden
from torch.utils.data import DataLoader, IterableDataset

from lightning_wm.data.acting import Acting, make_acting
from lightning_wm.data.batches.base import BatchSide
from lightning_wm.data.evaluation import check_eval_env, evaluation_loader, play_evaluation
from lightning_wm.data.ranks import rank_and_world
from lightning_wm.data.replay import ReplayBuffer
from lightning_wm.data.settings import ActingSettings, EvalSettings
from lightning_wm.envs import EnvConfig, EnvSpec, env_spec
from lightning_wm.protocols import EnvStats
from lightning_wm.seeding import derive_seed, env_seeds
from lightning_wm.settings import as_settings
from lightning_wm.signals import check_stop_between_batches

__all__ = ["OnlineDataModule"]


class BatchAtStep:
    """What the training stream yields with ``acting.fetch_ahead: false``: a placeholder that
    :meth:`OnlineDataModule.make_batch_at_step` (the datamodule's ``on_before_batch_transfer``
    then) replaces with the real batch just before the step that trains on it (Lightning fetches
    one batch ahead of the step)."""


class _Stream(IterableDataset):
    """Infinite stream of training batches (one epoch; stop with ``trainer.max_steps``); with
    the datamodule's ``fetch_ahead`` false, of :class:`BatchAtStep` placeholders."""

    def __init__(self, datamodule: OnlineDataModule) -> None:
        self.datamodule = datamodule

    def __iter__(self) -> Iterator[dict[str, Any] | BatchAtStep]:
        datamodule = self.datamodule
        while True:
            check_stop_between_batches()  # a scheduler's stop: end after the step before, exactly
            yield datamodule.next_batch() if datamodule.fetch_ahead else BatchAtStep()


class OnlineDataModule(pl.LightningDataModule):
    """Base of :class:`~lightning_wm.data.modules.ReplayDataModule` and
    :class:`~lightning_wm.data.modules.UnrollDataModule`.

    Protocols (:mod:`lightning_wm.protocols`): :class:`~lightning_wm.protocols.AgentSink` (the
    ``AgentPublisher`` callback attaches the module being trained), ``EnvStepCounter``,
    ``EnvStatsSource``, ``FeedbackSink``, ``ReplayHolder``, ``ImaginationHost``, ``EnvHolder``.

    Seeds derive from ``env.seed`` (:mod:`lightning_wm.seeding`) by role and DDP rank: the
    training envs ``train``, the random prefill ``prefill``, the buffers' sampling ``replay``,
    the validation envs ``eval``.

    Args:
        env: the training environment; its ``seed`` is the root of this module's seeds.
        eval: the validation episodes.
        acting: how rows are made.
        batches: the batch side.
        chunk_length: env steps per chunk of the acting part.
        overlap: chunks overlap by one row (unrolls).
    """

    def __init__(
        self,
        env: EnvConfig,
        eval: EvalSettings | None,
        acting: ActingSettings | None,
        batches: BatchSide,
        chunk_length: int,
        overlap: bool = False,
    ) -> None:
        super().__init__()
        self.env = env
        self.spec: EnvSpec = env_spec(env)
        self.eval = as_settings(EvalSettings, eval, "eval")
        check_eval_env(env, self.spec, self.eval)
        acting = as_settings(ActingSettings, acting, "acting")
        self.fetch_ahead = acting.fetch_ahead
        if not self.fetch_ahead:
            self.on_before_batch_transfer = self.make_batch_at_step  # type: ignore[method-assign]
        self.acting: Acting = make_acting(env, self.spec, acting, chunk_length, overlap)
        self.batches = batches
        self._built = False
        self._pending_state: dict[str, Any] | None = None

    # -- lifecycle --------------------------------------------------------------------------
    def setup(self, stage: str) -> None:
        """Build the batch side (once) and the acting part (again after a teardown)."""
        rank, _ = rank_and_world(self)
        if not self._built:
            self.batches.setup(self.acting, rank, derive_seed(self.env.seed, "replay", rank))
            self._built = True
        self.acting.setup(rank, self.batches.rows)
        if self._pending_state is not None:
            self._restore(self._pending_state)
            self._pending_state = None

    def teardown(self, stage: str) -> None:
        self._stop_acting()

    def on_exception(self, exception: BaseException) -> None:
        """Stop acting on Ctrl-C or an error (Lightning skips ``teardown`` then)."""
        self._stop_acting()

    def _stop_acting(self) -> None:
        self.acting.close()
        self.batches.close()

    def train_env_seeds(self) -> list[int]:
        """The first-reset seeds of this rank's training envs (one per env, acting in process)."""
        return env_seeds(self.env.seed, self.env.num_envs, "train", rank_and_world(self)[0])

    # -- the agent (AgentSink) ----------------------------------------------------------------
    def attach_agent(self, agent: Any, version: int) -> None:
        """Act with ``agent`` from now on; ``version``: its weights' version (the learner's
        optimizer steps). In process the live module acts; actors get ``agent.acting_copy()``
        (started at the first call, new versions every ``acting.publish_every`` steps)."""
        self.batches.use_agent(agent)
        self.acting.attach_agent(agent, version, random_rows=self.batches.random_rows())

    # -- env steps (EnvStepCounter, EnvStatsSource) -----------------------------------------------
    @property
    def env_steps(self) -> int:
        """This rank's env steps so far."""
        return self.acting.env_steps

    def pop_env_stats(self) -> EnvStats:
        """Env steps so far, the episodes finished since the last call, the actors' gauges."""
        return EnvStats(self.acting.env_steps, self.acting.pop_episodes(), self.acting.metrics())

    # -- loaders ----------------------------------------------------------------------------
    def next_batch(self) -> dict[str, Any]:
        """The next training batch (acting for it as the batch side needs)."""
        return self.batches.next_batch()

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_Stream(self), batch_size=None, num_workers=0)

    def make_batch_at_step(self, batch: Any, dataloader_idx: int) -> Any:
        """This datamodule's ``on_before_batch_transfer`` with ``acting.fetch_ahead: false`` (set
        per instance, so that with the default fetch the hook stays Lightning's and a model's own
        hook is used as usual): the batch a :class:`BatchAtStep` stands for is made now, the step
        before it having run, so its rows come from the newest weights; other batches pass. A
        model's own ``on_before_batch_transfer`` then runs on the result (Lightning calls only the
        datamodule's when both have one, and says so in a warning)."""
        trainer = getattr(self, "trainer", None)
        if isinstance(batch, BatchAtStep):
            batch = self.next_batch()
            if trainer is not None:
                batch = trainer.precision_plugin.convert_input(batch)
        model = getattr(trainer, "lightning_module", None)
        if model is not None and is_overridden("on_before_batch_transfer", model):
            batch = model.on_before_batch_transfer(batch, dataloader_idx)
        return batch

    def val_dataloader(self) -> DataLoader:
        return evaluation_loader(self.evaluate)

    test_dataloader = val_dataloader

    def evaluate(self, agent: Any, episodes: int | None = None) -> list[dict[str, float]]:
        """Run ``episodes`` (default ``eval.episodes``) episodes with ``explore=False`` in fresh envs
        of ``eval.env`` (default: ``env``); return their stats."""
        return play_evaluation(self.env, self.spec, self.eval, agent, episodes, rank_and_world(self)[0])

    # -- feedback (FeedbackSink), buffers (ReplayHolder), imagination (ImaginationHost) ------
    def apply_feedback(self, batch: dict[str, Any], feedback: dict[str, Any]) -> dict[str, int]:
        """Write a learner's feedback on ``batch`` back (see the batch side's ``apply_feedback``)."""
        return self.batches.apply_feedback(batch, feedback)

    def replay_buffers(self) -> dict[str, ReplayBuffer]:
        """The buffers this datamodule holds, by name (``BufferCheckpoint`` saves those with
        ``checkpoint`` set)."""
        return self.batches.replay_buffers()

    def real_buffer(self) -> ReplayBuffer:
        """The real rows imagined rollouts start from."""
        return self.batches.real_buffer()

    def set_imagination(self, buffer: ReplayBuffer | None, real_ratio: float) -> None:
        """Mix imagined rows from ``buffer`` into the batches, ``real_ratio`` of each batch real."""
        if not 0.0 <= real_ratio <= 1.0:
            raise ValueError(f"real_ratio must be in [0, 1], got {real_ratio}")
        self.batches.set_imagination(buffer, real_ratio)

    @property
    def imagination(self) -> ReplayBuffer | None:
        """The imagined rows mixed into the batches (``None`` until :meth:`set_imagination`)."""
        return self.batches.imagination

    # -- checkpoints ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The acting part's counts and the batch side's progress (one flat dict)."""
        trainer = getattr(self, "trainer", None)
        global_step = int(getattr(trainer, "global_step", 0) or 0)
        return {**self.acting.state_dict(), **self.batches.state_dict(global_step)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not self._built:
            self._pending_state = state  # restored in setup()
        else:
            self._restore(state)

    def _restore(self, state: dict[str, Any]) -> None:
        self.acting.load_state_dict(state)
        self.batches.load_state_dict(state)
