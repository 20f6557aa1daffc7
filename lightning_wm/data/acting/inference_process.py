"""Central inference in a process of its own (``acting.central_inference: process``).

With groups in processes (``acting.central_groups: processes``) the
:class:`~lightning_wm.data.acting.shared_inference.InferenceLoop` normally runs as a thread of the
learner, so on a CPU learner every policy call takes the learner's interpreter and core from its
gradient step. Here the loop is the body of one spawned process instead: it acts with a CPU
acting copy (``module.acting_copy()``) whose weights it pulls from a
:class:`~lightning_wm.data.acting.local.WeightStore` (the actors' shared-memory seqlock: the
learner never waits) just before each policy call that finds a newer version, and answers the
groups through the same shared slots. The learner publishes every ``acting.publish_every``
optimizer steps; answers carry the version the call acted with, so the policy lag is reported as
for any acting mode.

For a learner on a GPU keep the thread: the policy belongs on the learner's device, and a CUDA
call releases the interpreter while it runs.

Robustness is the worker processes' (:mod:`lightning_wm.data.acting.spawned`): the process dies
with the learner, ``kill -9`` included; its exception (with traceback), its death or a heartbeat
silent for ``acting.timeout_s`` (a policy call that hangs stops the beat) becomes one description
naming it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor, nn

from lightning_wm.data.acting.local import WeightStore, module_bytes, module_from_bytes
from lightning_wm.data.acting.shared_inference import InferenceLoop, ServedCounts, SharedSlots
from lightning_wm.data.acting.spawned import SpawnedWorkers, heartbeat_of, worker_process
from lightning_wm.data.acting.worker import acting_copy_ready

__all__ = ["InferenceProcess"]


def _inference_main(
    index: int,
    pickled: bytes,
    store: WeightStore,
    slots: SharedSlots,
    deadline_s: float,
    chunks: Any,
    errors: Any,
    stop: Any,
    heartbeat: Any,
    parent_pid: int,
) -> None:
    """Body of the inference process: answer the groups' rounds until ``stop`` is set."""
    with worker_process(index, chunks, errors, parent_pid):
        beat = heartbeat_of(heartbeat, index)
        module = acting_copy_ready(module_from_bytes(pickled))
        version = store.pull_into(module)

        def newest() -> int:
            nonlocal version
            if store.version != version:
                version = store.pull_into(module, known_version=version)
            beat()  # a policy call that hangs stops the beat
            return version

        InferenceLoop(module, slots, deadline_s, newest, stop=stop, thread=False).serve(beat)


class InferenceProcess(ServedCounts):
    """One spawned process answering the groups' requests in ``slots`` with a copy of ``acting_copy``.

    Args:
        acting_copy: a CPU acting module (``module.acting_copy()``); its ``state_dict`` layout is
            what every :meth:`publish` sends.
        version: the version of its weights.
        slots: the shared exchange (:func:`~lightning_wm.data.acting.shared_inference.make_slots`).
        deadline_s: how long a round waits for the other active groups after its first request.
    """

    def __init__(self, acting_copy: nn.Module, version: int, slots: SharedSlots, deadline_s: float) -> None:
        if any(t.device.type != "cpu" for t in acting_copy.state_dict().values()):
            raise ValueError("the inference process acts with a CPU acting copy (module.acting_copy())")
        self.slots = slots
        self.store = WeightStore(acting_copy, version)
        self.workers = SpawnedWorkers(
            _inference_main,
            (module_bytes(acting_copy), self.store, slots, float(deadline_s)),
            1,
            1,  # a queue it never uses: the workers' frame wants one
            "central inference process",
        )

    def publish(self, weights: Mapping[str, Tensor] | nn.Module, version: int) -> None:
        """Make ``weights`` (the acting copy's ``state_dict`` layout) the ones the next policy call
        acts with, as ``version``."""
        self.store.publish(weights, version)

    def pids(self) -> list[int | None]:
        return self.workers.pids()

    def failure(self, timeout_s: float) -> str | None:
        """The process raised, died or was silent (a hung policy call) for ``timeout_s``; else ``None``."""
        return self.workers.failure(timeout_s)

    def close(self) -> None:
        """Stop the process (idempotent)."""
        self.workers.close()
