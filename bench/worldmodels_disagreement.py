"""The disagreement of an ensemble of Ms (section 6 of ``bench/worldmodels_dream_diagnostics.py``,
and its controllers' dreams in section 5): M and the ``--ensemble`` Ms read the same rows, and
their disagreement is the std over members of each one's mixture mean, averaged over ``z``'s
dimensions; measured on real episodes (teacher-forced), along a controller's dreams and along
dreams under random actions.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import numpy as np


def build_ensemble(args: argparse.Namespace, model: Any) -> tuple[Any, list]:
    """M with the ``--ensemble`` Ms beside it, and the members (M first)."""
    from lightning_wm.agents.worldmodels.memory import Memory
    from lightning_wm.agents.worldmodels.vm_model import VisionMemoryModel
    from lightning_wm.checkpoints import load_module

    mem = model.memory
    ensemble = VisionMemoryModel(
        model.vision, mem, temperature=args.temperature, ensemble=[load_module(Memory, path) for path in args.ensemble]
    )
    members = [mem, *ensemble.ensemble]
    return ensemble, members


def member_heads(members: list, outs: list) -> list[dict]:
    """Each member's heads on its own output."""
    return [member.heads(out) for member, out in zip(members, outs)]


def disagreement(members: list, heads: list[dict]) -> np.ndarray:
    """Std over members of each member's mixture mean, averaged over z's dimensions: ``[B]``."""
    import torch

    means = [member.mean_next(h) for member, h in zip(members, heads)]
    return torch.stack(means).std(0).mean(-1).numpy()


def teacher_forced_disagreement(ensemble: Any, members: list, e: dict) -> np.ndarray:
    """The members' disagreement at every row of the real episode ``e``, reading V's mean."""
    import torch

    mem = members[0]
    with torch.no_grad():
        z = torch.as_tensor(e["mu"])
        actions = mem.action_input(torch.as_tensor(e["action"]))
        state, out = ensemble.zero_state(1), []
        for t in range(len(z) - 1):
            outs, state = ensemble.read_step({**state, "z": z[t : t + 1]}, actions[t : t + 1])
            out.append(disagreement(members, member_heads(members, outs))[0])
        return np.asarray(out)


def dream_disagreement(
    args: argparse.Namespace, ensemble: Any, members: list, controller: Any, act: Callable, steps: int = 300
) -> list[float]:
    """Disagreement at every step of ``args.dreams`` dreams from the controller's (ensemble)
    starts, ends ignored (a dream runs on for ``steps`` from a first-row start); ``z'`` is
    drawn from M's mixture, every member reading it."""
    import torch

    mem = members[0]
    with torch.no_grad():
        bank = controller.dream_starts_bank()  # the controller dreams with the ensemble (dream.ensemble)
        g = torch.Generator().manual_seed(args.seed)
        pick = torch.randint(len(bank["z"]), (args.dreams,), generator=g)
        state = {k: v[pick] for k, v in bank.items()}
        out = []
        for _ in range(steps):
            action = act(ensemble.features(state))
            outs, new = ensemble.read_step(state, mem.action_input(action))
            heads = member_heads(members, outs)
            out.extend(disagreement(members, heads).tolist())
            new["z"] = mem.sample_next(heads[0], args.temperature, g)
            state = new
        return out


def ensemble_section(
    args: argparse.Namespace, episodes: list[dict], ensemble: Any, members: list, controller: Any, report: dict
) -> None:
    """6. ensemble disagreement: real episodes (teacher-forced), controllers' dreams, random-action dreams."""
    import torch

    real = {}
    for e in episodes:
        real.setdefault(e["policy"], []).append(teacher_forced_disagreement(ensemble, members, e))
    rows = [(f"real {policy} episodes, teacher-forced", np.concatenate(v)) for policy, v in real.items()]
    rows += [
        (f"dreams of {c['checkpoint']}", np.asarray(c["dream_disagreement"]))
        for c in report["controllers"]
        if "dream_disagreement" in c
    ]
    if args.controller:
        gen_random = torch.Generator().manual_seed(args.seed)
        rows.append(
            (
                "dreams under random actions",
                np.asarray(
                    dream_disagreement(
                        args,
                        ensemble,
                        members,
                        controller,
                        lambda f: torch.randint(2, (f.shape[0],), generator=gen_random),
                    )
                ),
            )
        )
    report["ensemble_disagreement"] = {name: [float(q) for q in np.quantile(v, [0.5, 0.9, 0.99])] for name, v in rows}
    print(
        f"\n6. ensemble of {1 + len(args.ensemble)} Ms: disagreement per step (std over members of the "
        "mixture mean, mean over z's dimensions)"
    )
    print("| where | median | 90% | 99% | steps |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, v in rows:
        q = np.quantile(v, [0.5, 0.9, 0.99])
        print(f"| {name} | {q[0]:.4f} | {q[1]:.4f} | {q[2]:.4f} | {len(v)} |")
