"""MCTS speed: simulations per second of one batched search, ours (``lightning_wm.search.muzero_policy``)
and LightZero 0.2.0's C++ tree (``ctree``) on the same network in the same process.

    python bench/mcts_speed.py                                   # ours only (LightZero absent)
    PYTHONPATH=. /work/venvs/lightzero/bin/python bench/mcts_speed.py   # both (bench/install_lightzero.sh)
    python bench/mcts_speed.py --batch 64 --simulations 50 --threads 1 2 --repeats 7
    python bench/mcts_speed.py --batch 64 --threads 1 --kernels   # and the kernels each search dispatches

The network is the CartPole MuZero network of LightZero's config (latent 128, two hidden layers
of 128, heads of 32, value and reward over 601 bins), built as a ``MuZeroModel`` in eval mode
and called under ``torch.no_grad()``; both searches get the same root states, logits and values
(the root inference is outside the timing) and use PUCT with Dirichlet noise (alpha 0.3, weight
0.25), pb_c 1.25 / 19652 and discount 0.997, an untried action valued at the mean Q of its
tried siblings as LightZero does (``--unvisited-q zero`` for the pseudocode's 0 in ours). Ours runs twice: eager, and with
``compile=True`` (``search.compile``: each simulation, our network's step and the tree's, as one
``torch.compile`` graph; its one-time compilation falls in the warm-up and is printed apart). ``sims/s = batch * simulations / seconds`` of one
whole search, median over ``--repeats`` rounds after one warm-up, the searches taking turns
within a round; the process CPU time is given beside the wall time (on a shared machine it is the
steadier of the two; with 2 threads it counts both). Each search's network time (our
``recurrent_fn``, which decodes value and reward; LightZero's ``recurrent_inference``, whose
decoding LightZero does outside it) is reported too, except for our compiled search, where the
network is inside the compiled graph (``-``). LightZero's tree is imported only when it is
installed in the running Python.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import gymnasium as gym  # noqa: E402

from lightning_wm.agents.muzero import MuZeroModel, MuZeroNet  # noqa: E402
from lightning_wm.search import Root, SearchSettings, muzero_policy  # noqa: E402

DISCOUNT = 0.997


def cartpole_model(seed: int = 0) -> MuZeroModel:
    """LightZero's CartPole MuZero sizes, random weights (heads not zero, so the search branches)."""
    torch.manual_seed(seed)
    net = MuZeroNet(latent_dim=128, hidden=128, layers=2, head_hidden=32, support_size=300)
    model = MuZeroModel(gym.spaces.Box(-np.inf, np.inf, (4,), np.float32), 2, net)
    for head in (model.policy_head, model.value_head, model.reward_head):
        for p in head.parameters():
            torch.nn.init.normal_(p, std=0.05)
    return model.eval().requires_grad_(False)


class Timed:
    """Wraps a callable and adds up the seconds spent in it."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn, self.seconds = fn, 0.0

    def __call__(self, *args: Any) -> Any:
        t = time.perf_counter()
        out = self.fn(*args)
        self.seconds += time.perf_counter() - t
        return out


def ours(
    model: MuZeroModel,
    root: dict[str, torch.Tensor],
    simulations: int,
    seed: int,
    unvisited_q: str = "mean",
    compile: bool = False,
) -> tuple[float, float]:
    # compiled, the network is traced into each simulation's graph: no timer around it there
    rec = model.recurrent_fn if compile else Timed(model.recurrent_fn)
    settings = SearchSettings(
        num_simulations=simulations, dirichlet_alpha=0.3, unvisited_q=unvisited_q, compile=compile
    )
    t = time.perf_counter()
    muzero_policy(
        rec,
        Root(root["state"], root["policy_logits"], root["value"]),
        settings,
        discount=DISCOUNT,
        generator=torch.Generator().manual_seed(seed),
    )
    return time.perf_counter() - t, rec.seconds if isinstance(rec, Timed) else float("nan")


def lightzero_search() -> Callable[..., tuple[float, float]] | None:
    """LightZero's ctree search on our network, or ``None`` where LightZero is not installed."""
    try:
        from easydict import EasyDict
        from lzero.mcts.tree_search.mcts_ctree import MuZeroMCTSCtree
    except ImportError:
        return None

    def run(model: MuZeroModel, root: dict[str, torch.Tensor], simulations: int, seed: int) -> tuple[float, float]:
        rng = np.random.default_rng(seed)
        cfg = EasyDict(
            dict(
                num_simulations=simulations,
                discount_factor=DISCOUNT,
                device="cpu",
                model=dict(support_scale=300, categorical_distribution=True),
            )
        )
        search = MuZeroMCTSCtree(cfg)

        def infer(latent: torch.Tensor, action: torch.Tensor) -> SimpleNamespace:
            # LightZero decodes the categorical value and reward itself
            reward_logits, state = model.dynamics(latent.float(), action)
            policy_logits, value_logits = model.prediction(state)
            return SimpleNamespace(
                latent_state=state, policy_logits=policy_logits, value=value_logits, reward=reward_logits
            )

        net = SimpleNamespace(recurrent_inference=Timed(infer), eval=lambda: None)
        batch, actions = root["policy_logits"].shape
        t = time.perf_counter()
        roots = MuZeroMCTSCtree.roots(batch, [list(range(actions))] * batch)
        noises = [rng.dirichlet([0.3] * actions).astype(np.float32).tolist() for _ in range(batch)]
        roots.prepare(0.25, noises, [0.0] * batch, root["policy_logits"].numpy().tolist(), [-1] * batch)
        search.search(roots, net, root["state"].numpy(), [-1] * batch)
        roots.get_distributions()
        roots.get_values()
        return time.perf_counter() - t, net.recurrent_inference.seconds

    return run


def measure(
    searches: dict[str, Callable[..., tuple[float, float]]],
    model: MuZeroModel,
    batch: int,
    simulations: int,
    repeats: int,
) -> dict[str, dict[str, float]]:
    """Median wall seconds, process CPU seconds and network seconds per search, for every search,
    over ``repeats`` rounds after one warm-up; the searches take turns within a round so that a
    shared machine's load falls on all of them alike."""
    rng = torch.Generator().manual_seed(batch)
    obs = torch.randn(batch, 4, generator=rng) * 0.5
    runs: dict[str, list[tuple[float, float, float]]] = {name: [] for name in searches}
    with torch.no_grad():
        root = model.initial_inference(obs)
        first = {}
        for name, fn in searches.items():  # the warm-up: a compiled search compiles here
            t = time.perf_counter()
            fn(model, root, simulations, 0)
            first[name] = time.perf_counter() - t
        for i in range(repeats):
            for name, fn in searches.items():
                cpu = time.process_time()
                wall, net = fn(model, root, simulations, i + 1)
                runs[name].append((wall, time.process_time() - cpu, net))
    return {
        name: {
            "wall": statistics.median(r[0] for r in rs),
            "cpu": statistics.median(r[1] for r in rs),
            "network": statistics.median(r[2] for r in rs),
            "first": first[name],
        }
        for name, rs in runs.items()
    }


def kernels_per_search(model: MuZeroModel, batch: int, simulations: int, compile: bool) -> int:
    """Kernels one of our searches dispatches (``bench/learner_speed.py``'s count: aten ops that run
    one, compiled kernels as one each): what a GPU pays per search eagerly, and per replay of the
    captured simulation loop (``search.cuda_graphs``, with ``compile`` the compiled simulations)."""
    import torch._inductor.config as inductor_config

    sys.path.append(os.path.dirname(__file__))
    from learner_speed import dispatched_ops

    inductor_config.cpp.enable_kernel_profile = True  # compiled kernels show up in the count
    with torch.no_grad():
        root = model.initial_inference(torch.randn(batch, 4, generator=torch.Generator().manual_seed(batch)) * 0.5)
        ours(model, root, simulations, 0, compile=compile)  # the warm-up (a compile)
        kernels, _ = dispatched_ops(lambda: ours(model, root, simulations, 1, compile=compile))
    return kernels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--simulations", type=int, default=50)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--unvisited-q",
        choices=["mean", "zero"],
        default="mean",
        help="our PUCT's value of an untried action (mean: MuZero's default and LightZero's rule)",
    )
    parser.add_argument(
        "--no-compile",
        action="store_true",
        help="leave out our search with its tree steps compiled (torch.compile, needs a C++ compiler)",
    )
    parser.add_argument(
        "--kernels", action="store_true", help="also count the kernels each of our searches dispatches (profiler)"
    )
    args = parser.parse_args()

    model = cartpole_model()
    searches = {"lightning_wm": functools.partial(ours, unvisited_q=args.unvisited_q)}
    if not args.no_compile:
        searches["lightning_wm search.compile"] = functools.partial(ours, unvisited_q=args.unvisited_q, compile=True)
    lz = lightzero_search()
    if lz is None:
        print(
            "LightZero is not installed in this Python: measuring lightning_wm only "
            "(run with the LightZero venv's python to compare)."
        )
    else:
        searches["LightZero ctree"] = lz
    print(f"torch {torch.__version__}, load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs\n")
    print(
        "| search | threads | batch | simulations | s / search (wall) | sims/s (wall) | CPU s / search | "
        "sims/s (CPU) | network s / search | first search s |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for batch in args.batch:
            results = measure(searches, model, batch, args.simulations, args.repeats)
            sims = batch * args.simulations
            for name, r in results.items():
                print(
                    f"| {name} | {threads} | {batch} | {args.simulations} | {r['wall']:.4f} | {sims / r['wall']:,.0f} | "
                    f"{r['cpu']:.4f} | {sims / r['cpu']:,.0f} | "
                    f"{'-' if math.isnan(r['network']) else format(r['network'], '.4f')} | {r['first']:.1f} |",
                    flush=True,
                )
    if args.kernels:
        print("\n| search | batch | kernels per search | per simulation |\n| --- | ---: | ---: | ---: |")
        for batch in args.batch:
            for compile in (False, True) if not args.no_compile else (False,):
                kernels = kernels_per_search(model, batch, args.simulations, compile)
                name = "lightning_wm search.compile" if compile else "lightning_wm"
                print(f"| {name} | {batch} | {kernels:,} | {kernels / args.simulations:.1f} |", flush=True)


if __name__ == "__main__":
    main()
