"""Train a stopped MuZero run on, offline, on its own replay (no new frames, no reanalyse) with some
settings changed, and probe it (``bench/muzero_probe.py``) every ``--every`` steps: whether a head
the probe found blind can learn from the data the run already has, and which setting lets it.

    python bench/muzero_offline_fit.py /work/runs/rea/rd2/muzero-asterix-seed0 --steps 3000 \\
        --set loss.reward_weight=4

``--set GROUP.FIELD=VALUE`` changes a field of the module's ``loss`` or ``optim`` group (a float).
The probe's windows are drawn once (seeded) before training; the batches are drawn by the run's
own sampler. Prints the probe's figures named by ``--show`` (substrings) at step 0 and every
``--every`` steps, and the seconds a step took.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Callable
from typing import Any

from muzero_probe import probe
from probelib import probe_parser, run_windows

from lightning_wm.agents.muzero import MuZero
from lightning_wm.optim import split_lr_schedule

GROUPS = ("loss", "optim")


def apply_settings(module: MuZero, changes: list[str]) -> None:
    """``GROUP.FIELD=VALUE`` changes of the module's ``loss`` / ``optim`` groups, in place."""
    for change in changes:
        name, _, value = change.partition("=")
        group, _, field = name.partition(".")
        if group not in GROUPS or not value or not hasattr(getattr(module, group), field):
            raise SystemExit(f"error: --set {change!r}: give GROUP.FIELD=VALUE with GROUP one of {GROUPS}")
        setattr(module, group, dataclasses.replace(getattr(module, group), **{field: float(value)}))


def fit(
    module: MuZero, buffer_batch: Callable[[], dict[str, Any]], steps: int, every: int, report: Callable[[int], None]
) -> float:
    """``steps`` gradient steps on batches ``buffer_batch()`` with the module's own optimizer,
    gradient clipping and learning-rate schedule (the schedule counts from this fit's first step);
    ``report(step)`` at 0 and every ``every``; returns the seconds a step took."""
    module.reanalyse = dataclasses.replace(module.reanalyse, ratio=0.0)
    module._unroll_loss = module.unroll_loss  # eager: the compiled step is not needed here
    optimizer, schedule = split_lr_schedule(module.configure_optimizers())
    report(0)
    start = time.perf_counter()
    for step in range(1, steps + 1):
        module.train()
        loss = module.training_step(buffer_batch(), step)["loss"]
        optimizer.zero_grad()
        loss.backward()
        module.configure_gradient_clipping(optimizer)
        optimizer.step()
        if schedule is not None:
            schedule["scheduler"].step()
        module.update_target(step)
        if step % every == 0:
            report(step)
    return (time.perf_counter() - start) / max(steps, 1)


def main() -> None:
    parser = probe_parser(__doc__)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--every", type=int, default=500)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--set", action="append", default=[], help="GROUP.FIELD=VALUE (loss or optim)")
    parser.add_argument(
        "--show", nargs="+", default=["1 step(s) in: predicted on", "1 step(s) in: rewards seen", "1 step(s) in: AUC"]
    )
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message=".*self.log.*")  # no Trainer: the step's logging goes nowhere
    module, buffer, fixed = run_windows(MuZero, args, __file__)
    module.model.requires_grad_(True)
    apply_settings(module, args.set)
    sampler = module.replay_sampler()

    def report(step: int) -> None:
        module.eval()
        figures = probe(module, fixed)
        shown = [f"{k} {v:.3f}" for k, v in figures.items() if any(s in k for s in args.show)]
        print(f"step {step:>6}: " + "; ".join(shown), flush=True)

    seconds = fit(module, lambda: sampler.sample(buffer, args.batch_size), args.steps, args.every, report)
    print(f"{seconds:.3f} s a step; settings changed: {args.set or 'none'}")


if __name__ == "__main__":
    main()
