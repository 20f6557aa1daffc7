"""Policy copies in ``spawn``-ed actor processes (``acting.backend: local``; what keeps them robust:
:mod:`~lightning_wm.data.acting.spawned`): weights in a shared-memory :class:`WeightStore` (seqlock:
the learner never waits for an actor), chunks through a bounded queue.
"""

from __future__ import annotations

import ctypes
import io
import time
from collections.abc import Mapping

import torch
import torch.multiprocessing as tmp
from torch import Tensor, nn

from lightning_wm.data.acting.base import Pool
from lightning_wm.data.acting.spawned import Link, SpawnedWorkers, put_chunk, worker_process
from lightning_wm.data.acting.worker import ActingJob, ActorWorker, acting_copy_ready, seed_policy_draws

__all__ = ["LocalPool", "WeightStore"]


class WeightStore:
    """A shared-memory copy of an acting module's ``state_dict`` plus a version counter.

    One writer (the learner) and any number of readers (actor processes that received the
    store as a ``spawn`` argument). A sequence lock keeps reads consistent without ever
    making the writer wait: :meth:`publish` makes the sequence odd, copies, sets the version
    and makes it even again; :meth:`pull_into` copies and retries if the sequence was odd or
    changed meanwhile. A reader killed mid-copy therefore cannot block the learner.

    Args:
        module: the acting module whose ``state_dict`` layout (keys, shapes, dtypes) every
            later :meth:`publish` must keep; its weights are the store's first version. The store
            carries it to the processes (:meth:`new_module`).
        version: the version of those weights.
    """

    def __init__(self, module: nn.Module, version: int = 0) -> None:
        state = module.state_dict()
        self._tensors = {k: v.detach().to("cpu", copy=True).contiguous().share_memory_() for k, v in state.items()}
        ctx = tmp.get_context("spawn")
        self._seq = ctx.RawValue(ctypes.c_int64, 0)
        self._version = ctx.RawValue(ctypes.c_int64, int(version))
        # pickled by value: a tensor handed to a ``spawn`` child as it is would be moved to shared
        # memory and stay shared with the learner's module, which keeps training
        buffer = io.BytesIO()
        torch.save(module, buffer)
        self._module = buffer.getvalue()

    def new_module(self) -> nn.Module:
        """A copy of the module the store was made with, its first weights included (in the process
        that acts with it)."""
        return torch.load(io.BytesIO(self._module), weights_only=False)

    @property
    def version(self) -> int:
        """The newest published version."""
        return int(self._version.value)

    def publish(self, weights: Mapping[str, Tensor] | nn.Module, version: int) -> None:
        """Copy ``weights`` (an acting copy's ``state_dict``, or the module) into the store as ``version``."""
        state = weights.state_dict() if isinstance(weights, nn.Module) else weights
        if state.keys() != self._tensors.keys():
            missing, extra = self._tensors.keys() - state.keys(), state.keys() - self._tensors.keys()
            raise ValueError(
                f"acting module's state_dict changed keys (missing {sorted(missing)}, "
                f"new {sorted(extra)}); "
                "acting_copy() and acting_weights() must keep the same layout for the weight store"
            )
        self._seq.value += 1  # odd: a write is in progress
        with torch.no_grad():
            for key, target in self._tensors.items():
                target.copy_(state[key])
        self._version.value = int(version)
        self._seq.value += 1  # even: consistent again

    def pull_into(self, module: nn.Module, known_version: int | None = None, timeout_s: float = 10.0) -> int:
        """Copy the newest weights into ``module`` (in place); returns their version.

        Skips the copy when the store holds ``known_version`` already.

        Raises:
            TimeoutError: no consistent copy within ``timeout_s`` (the writer kept writing).
        """
        deadline = time.monotonic() + timeout_s
        targets = module.state_dict()
        while True:
            start = self._seq.value
            if start % 2 == 0:
                version = int(self._version.value)
                if version == known_version:
                    if self._seq.value == start:
                        return version
                    continue
                with torch.no_grad():
                    for key, source in self._tensors.items():
                        targets[key].copy_(source)
                if self._seq.value == start:
                    return version
            if time.monotonic() > deadline:
                raise TimeoutError(f"no consistent read of the weight store within {timeout_s} s")
            time.sleep(0.0005)


def _actor_main(actor: int, job: ActingJob, store: WeightStore, link: Link) -> None:
    """Body of actor process ``actor``: chunks into ``link.chunks`` until ``link.stop`` is set."""
    with worker_process(actor, link) as (holder, beat):
        seed_policy_draws(job, actor)
        module = store.new_module()
        worker = holder[0] = ActorWorker(actor, job, acting_copy_ready(module))
        version = job.version  # the weights the actor was built with
        while not link.stop.is_set():
            beat()
            if worker.random_left <= 0:
                version = store.pull_into(module, known_version=version)
            put_chunk(worker.chunk(version), link.chunks, link.stop, beat)


class LocalPool(Pool):
    """``acting.num_actors`` actor processes acting with copies of ``module`` (a CPU acting copy)
    refreshed from a :class:`WeightStore`; ``acting.queue_size`` chunks (default 2 per actor) wait."""

    def __init__(self, job: ActingJob, module: nn.Module) -> None:
        super().__init__(job.settings.timeout_s)
        count = job.settings.num_actors
        self.store = WeightStore(module, job.version)
        args = (job, self.store)
        self.sources = [SpawnedWorkers(_actor_main, args, count, job.settings.queue_size or 2 * count, "actor {}")]

    def publish(self, weights: Mapping[str, Tensor] | nn.Module | None, version: int) -> None:
        if weights is not None:
            self.store.publish(weights, version)
