"""Env frames per second with the learner consuming, for 0/1/2/4 actors; prints a markdown table.

Actors run in either acting mode (``acting.policy``): ``copies`` (each actor process acts with its
own CPU copy of the policy, new weights every 50 steps) and ``central`` (one batched call of the
learner's live policy acts for all env groups): ``central-sync`` / ``central-async`` run the groups
as threads of the learner's process, their envs stepped in the thread (``sync``) or in worker
processes (``async``); ``central-processes`` runs each group in its own process, which steps its
envs and builds its rows there, answered by an inference process with the policy's published copy
(``acting.central_groups: processes``).

For each env and actor count it measures, after a warm-up, for ``--seconds`` seconds:

* **flat out**: the actors act as fast as they can while the learner trains without pause
  (every step it ingests the chunks that arrived, samples a batch from the ReplayBuffer and takes
  an Adam step of the policy network): env frames (agent steps) per second reaching the buffer,
  and the learner's gradient steps per second. With 0 actors the learner acts itself, one chunk
  per gradient step (today's in-process path), and "wait" is the share of time spent acting;
  ``--splits 1,2`` measures in process and policy-copy actors with the envs in that many parts
  stepped in turn (``acting.splits``: each part's env step overlaps the policy's call for the next).
* **keep up**: the same with the replay ratio enforced (``ReplayFeed``) at half the rows per
  gradient step that "flat out" delivered: the actors keep up, and the learner's wait for rows as
  a share of its wall time is the number to watch (goal: <= 5%).

First it measures the ceiling (``bench/ceiling.py``: the env alone, random actions, no learner, on
every core, gymnasium and EnvPool) and prints its table; each frames/s figure is then also given as
a share of the best engine's rate. Envs: CartPole-v1 (MLP policy) and ALE/Pong-v5 through
gymnasium's ``AtariPreprocessing`` (84x84 gray, frame skip 4) and ``FrameStackObservation`` (4) -- the env options
``atari_preprocessing: {}`` and ``frame_stack: 4`` -- with a small conv policy; Pong needs
opencv (``pip install -e ".[atari]"``). One Pong frame here is one agent step (4 emulator
frames).

    python bench/actors.py                      # both envs, 0/1/2/4 actors, 20 s each
    python bench/actors.py --quick              # CartPole, 0/2 actors, 4 s each (a smoke run)
    python bench/actors.py --envs pong --actors 2 --seconds 30
    python bench/actors.py --backend envpool    # the acting modes step EnvPool's envs
    python bench/actors.py --envs cartpole --actors 0,2 --policies central --vectorizations sync,async
    python bench/actors.py --envs pong --actors 2 --policies central --central-groups processes
    python bench/actors.py --envs pong --actors 2 --backend envpool --acting-only   # no learner beside the actors
    python bench/actors.py --envs pong --actors 0 --backend envpool --splits 1,2 --prefill 20000   # double-buffered
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.append(str(Path(__file__).resolve().parent))  # last: bench/minatar.py must not shadow minatar
import ceiling  # noqa: E402

from lightning_wm.data.acting import Chunk, make_acting  # noqa: E402
from lightning_wm.data.batches import ReplayFeed  # noqa: E402
from lightning_wm.data.replay import ReplayBuffer  # noqa: E402
from lightning_wm.data.samplers import RowSampler  # noqa: E402
from lightning_wm.data.settings import ActingSettings  # noqa: E402
from lightning_wm.data.split_collector import make_collector  # noqa: E402
from lightning_wm.envs import AtariPreprocessingConfig, EnvConfig, env_spec  # noqa: E402


class MLPPolicy(nn.Module):
    """Categorical policy over a vector observation (CartPole): 2 x 64 tanh."""

    def __init__(self, obs_dim: int, actions: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(obs_dim, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, actions)
        )

    @property
    def device(self) -> torch.device:
        """Where the policy lives: the acting parts move observations there."""
        return next(self.parameters()).device

    def logits(self, obs: torch.Tensor) -> torch.Tensor:
        return self.net(obs.float())

    def initial_state(self, batch_size: int) -> None:
        return None

    def act(self, obs: torch.Tensor, state: None, explore: bool):
        logits = self.logits(obs)
        action = torch.distributions.Categorical(logits=logits).sample() if explore else logits.argmax(-1)
        return action, state, {"logits": logits}


class ConvPolicy(MLPPolicy):
    """Categorical policy over stacked 84x84 gray frames ``uint8 [B, 84, 84, 4]`` (Pong)."""

    def __init__(self, channels: int, actions: int) -> None:
        nn.Module.__init__(self)
        self.net = nn.Sequential(
            nn.Conv2d(channels, 16, 8, stride=4),
            nn.ReLU(),
            nn.Conv2d(16, 32, 4, stride=2),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(32 * 9 * 9, 128),
            nn.ReLU(),
            nn.Linear(128, actions),
        )

    def logits(self, obs: torch.Tensor) -> torch.Tensor:
        return self.net(obs.permute(0, 3, 1, 2).float() / 255.0)


def settings(name: str, backend: str = "gymnasium", device: str = "cpu", envs_per_actor: int | None = None) -> dict:
    """The bench's setup for env ``name``; ``envs_per_actor`` replaces its default (16 CartPole, 4 Pong),
    in process too."""
    s = _settings(name, backend, device)
    return {**s, "envs_per_actor": envs_per_actor or s["envs_per_actor"]}


def _settings(name: str, backend: str, device: str) -> dict:
    if name == "cartpole":
        env = EnvConfig("CartPole-v1", backend=backend)
        spec = env_spec(env)
        return dict(
            env=env,
            policy=lambda: MLPPolicy(spec.obs_shape[0], spec.action_dim),
            device=device,
            envs_per_actor=16,
            chunk_length=64,
            batch=256,
            capacity=200_000,
            skip=1,
        )
    if name == "pong":
        env = EnvConfig(
            "ALE/Pong-v5",
            atari_preprocessing=AtariPreprocessingConfig(),
            frame_stack=4,
            max_episode_steps=27_000,
            backend=backend,
        )
        spec = env_spec(env)
        return dict(
            env=env,
            policy=lambda: ConvPolicy(spec.obs_shape[-1], spec.action_dim),
            device=device,
            envs_per_actor=4,
            chunk_length=32,
            batch=32,
            capacity=20_000,
            skip=4,
        )
    raise ValueError(f"unknown env {name!r}; choose cartpole or pong")


class Learner:
    """Samples rows uniformly and takes an Adam step of a behaviour-cloning loss on them."""

    def __init__(self, policy: nn.Module, buffer: ReplayBuffer, batch: int) -> None:
        self.policy, self.buffer, self.batch = policy, buffer, batch
        self.sampler = RowSampler()
        self.optimizer = torch.optim.Adam(policy.parameters(), lr=1e-4)
        self.steps = 0

    def step(self) -> None:
        batch = self.sampler.sample(self.buffer, self.batch)
        device = self.policy.device
        obs, action = batch["obs"].to(device, non_blocking=True), batch["action"].to(device, non_blocking=True)
        loss = nn.functional.cross_entropy(self.policy.logits(obs), action.long())
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        self.steps += 1


def in_process(s: dict, seconds: float, prefill: int, splits: int = 1) -> dict:
    """0 actors: the learner acts (one chunk per gradient step) and learns in turn; ``splits`` > 1
    steps the envs in that many parts in turn (``acting.splits``)."""
    n = s["envs_per_actor"]
    policy = s["policy"]().to(s["device"])
    buffer = ReplayBuffer(s["capacity"], n, seed=0)
    env = EnvConfig(**{**vars(s["env"]), "num_envs": n})
    collector = make_collector(env, policy.requires_grad_(True), buffer, list(range(n)), env_spec(env), splits)
    learner = Learner(policy, buffer, s["batch"])
    try:
        while len(buffer) < prefill:
            collector.collect(s["chunk_length"])
        rows0, steps0, acting, start = collector.stats.env_steps, learner.steps, 0.0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            t = time.perf_counter()
            collector.collect(s["chunk_length"])
            acting += time.perf_counter() - t
            learner.step()
        wall = time.perf_counter() - start
    finally:
        collector.close()
    return {
        "fps": (collector.stats.env_steps - rows0) / wall,
        "steps_per_s": (learner.steps - steps0) / wall,
        "wait": acting / wall,
    }


class Shipped:
    """A policy module as the acting part takes an agent: ``acting_copy()`` for the actors."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    @property
    def device(self) -> torch.device:
        return self.module.device

    def acting_copy(self) -> nn.Module:
        return copy.deepcopy(self.module).cpu().eval().requires_grad_(False)

    def acting_weights(self) -> dict[str, torch.Tensor]:
        return self.module.state_dict()


def with_actors(
    s: dict,
    actors: int,
    seconds: float,
    prefill: int,
    rows_per_step: float | None,
    mode: str = "copies",
    learn: bool = True,
    splits: int = 1,
    deadline_ms: float = ActingSettings.deadline_ms,
) -> dict:
    """Actors act (the datamodules' acting part: ``copies``, new weights every 50 steps, or
    ``central-sync`` / ``central-async``, the live policy, or ``central-processes``, the policy in a
    process of its own with weights published every 50 steps); the learner ingests what arrived and
    trains (``rows_per_step`` None: flat out, else the replay ratio ``1 / rows_per_step`` is
    enforced by :class:`ReplayFeed`). The learner (and with ``central`` the acting policy) lives on
    ``s["device"]``; policy copies act on the CPU. ``learn=False``: the learner only ingests (acting
    alone: what the acting side reaches without a learner beside it). ``splits``: each policy-copy
    actor steps its envs in that many parts in turn (``acting.splits``). ``deadline_ms``: central
    acting's ``acting.deadline_ms``."""
    policy = s["policy"]().to(s["device"])
    buffer = ReplayBuffer(s["capacity"], actors * s["envs_per_actor"], seed=0)
    learner = Learner(policy, buffer, s["batch"])
    central = mode.startswith("central")
    settings = ActingSettings(
        num_actors=actors,
        envs_per_actor=s["envs_per_actor"],
        publish_every=50,
        timeout_s=120,
        policy="central" if central else "copies",
        central_groups="processes" if mode.startswith("central-processes") else "threads",
        splits=1 if central else splits,
        deadline_ms=deadline_ms,
    )
    threads = mode in ("central-sync", "central-async")
    env = EnvConfig(**{**vars(s["env"]), "vectorization": mode.split("-")[1]}) if threads else s["env"]
    acting = make_acting(env, env_spec(env), settings, s["chunk_length"], overlap=False)
    acting.setup(rank=0)
    # central acting's thread takes the live module; copies and the inference process its published weights
    shipped = policy if central and mode != "central-processes" else Shipped(policy)
    acting.attach_agent(shipped if central else Shipped(s["policy"]()), 0)

    def ingest(chunk: Chunk) -> None:
        buffer.add_many(chunk.rows, streams=acting.streams(chunk))
        acting.received(chunk)

    try:
        feed = ReplayFeed(acting, buffer, replay_ratio=1.0 / (rows_per_step or 1.0), prefill=prefill)
        while len(buffer) < prefill:  # warm-up: every actor started and the buffer prefilled
            chunk = acting.next_chunk(timeout=300)
            if chunk is not None:
                ingest(chunk)
        rows0, steps0, waited, start = acting.env_steps, learner.steps, 0.0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            if rows_per_step is None:
                while (chunk := acting.next_chunk(timeout=0.0)) is not None:
                    ingest(chunk)
            else:
                waited += feed.before_batch()
            if learn:
                learner.step()
                acting.attach_agent(shipped, learner.steps)  # sent every publish_every steps
            elif (chunk := acting.next_chunk(timeout=0.05)) is not None:
                ingest(chunk)
        wall = time.perf_counter() - start
    finally:
        acting.close()
    rows = acting.env_steps - rows0
    return {"fps": rows / wall, "steps_per_s": (learner.steps - steps0) / wall, "wait": waited / wall}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--envs", default="cartpole,pong", help="comma-separated: cartpole, pong")
    p.add_argument("--actors", default="0,1,2,4", help="comma-separated actor counts")
    p.add_argument("--seconds", type=float, default=20.0, help="measured seconds per setting")
    p.add_argument("--prefill", type=int, default=2000, help="rows before measuring")
    p.add_argument("--backend", default="gymnasium", help="the acting modes' env backend: gymnasium or envpool")
    p.add_argument("--policies", default="copies,central", help="acting.policy of the actors: copies, central")
    p.add_argument(
        "--central-groups", default="threads,processes", help="where central env groups run: threads, processes"
    )
    p.add_argument(
        "--deadline-ms",
        type=float,
        default=ActingSettings.deadline_ms,
        help="central acting's acting.deadline_ms (default 5)",
    )
    p.add_argument(
        "--vectorizations", default="sync,async", help="env.vectorization of the central groups' threads: sync, async"
    )
    p.add_argument("--device", default="cpu", help="the learner's device (and central acting's): cpu or cuda")
    p.add_argument(
        "--envs-per-actor", type=int, default=None, help="envs per actor (and in process); default 16 CartPole, 4 Pong"
    )
    p.add_argument(
        "--splits",
        default="1",
        help="comma-separated acting.splits in process and in policy-copy actors (parts of the envs stepped in "
        "turn; >1 needs envpool or async)",
    )
    p.add_argument("--repeats", type=int, default=1, help="measure every setting this many times (medians)")
    p.add_argument(
        "--acting-only",
        action="store_true",
        help="the learner only ingests (no gradient steps): acting alone, one 'flat out' figure per mode",
    )
    p.add_argument("--quick", action="store_true", help="CartPole, 0 and 2 actors, 4 s each")
    args = p.parse_args()
    if args.quick:
        args.envs, args.actors, args.seconds, args.prefill = "cartpole", "0,2", 4.0, 1000
    return args


def measure_ceilings(args: argparse.Namespace) -> dict:
    """Print the machine line, then measure and print the ceiling of every env (``bench/ceiling.py``)."""
    load = os.getloadavg()[0]
    print(
        f"machine: {os.cpu_count()} CPUs, load average {load:.2f} at start; learner on {args.device}; torch threads 1 "
        f"in the learner and in each actor\n"
    )
    ceilings = {name: ceiling.measure(name, args.seconds) for name in args.envs.split(",")}
    print(ceiling.table([row for rows in ceilings.values() for row in rows]) + "\n")
    return ceilings


def print_table_header() -> None:
    """The header of the markdown table of acting modes."""
    print(
        "| env | actors | acting | envs/actor | chunk | frames/s, of ceiling (flat out) | learner steps/s "
        "| frames/s, of ceiling (keep up) "
        "| learner wait (keep up) |"
    )
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")


def acting_modes(args: argparse.Namespace) -> tuple[list[tuple[str, str, int]], list[tuple[str, str, int]]]:
    """(row label, acting mode, acting.splits) of the actors (policy copies at every ``--splits``,
    central with 1) and of 0 actors (in process at every ``--splits``)."""
    splits = [int(k) for k in args.splits.split(",")]
    # (row label, acting mode, acting.splits): policy copies at every --splits, central with 1
    modes = [("copies" if k == 1 else f"copies, {k} splits", "copies", k) for k in splits if "copies" in args.policies]
    if "central" in args.policies.split(","):
        groups = args.central_groups.split(",")
        modes += [(f"central-{v}", f"central-{v}", 1) for v in args.vectorizations.split(",") if "threads" in groups]
        if "processes" in groups:
            modes += [("central-processes, inference process", "central-processes", 1)]
    in_process_modes = [("in process" if k == 1 else f"in process, {k} splits", "in process", k) for k in splits]
    return modes, in_process_modes


def fps_text(s: dict, best: float, value: float) -> str:
    """Agent steps per second (and emulator frames with frame skip), % of ceiling."""
    frames = f" ({s['skip'] * value:,.0f} emulator)" if s["skip"] > 1 else ""
    return f"{value:,.0f}{frames}, {100 * value / best:.0f}%"


def report(name: str, s: dict, best: float, actors: int, mode: str, runs: list[dict]) -> None:
    """One table row: the medians of ``runs`` of one env, actor count and mode."""
    med = {k: float(np.median([r[k] for r in runs])) for k in runs[0]}
    keep_fps = fps_text(s, best, med["keep_fps"]) if "keep_fps" in med else "-"
    wait = f"{100 * med['wait']:.0f}% acting" if actors == 0 else f"{100 * med['wait']:.1f}%"
    print(
        f"| {name} | {actors} | {mode} | {s['envs_per_actor']} | {s['chunk_length']} | {fps_text(s, best, med['fps'])} "
        f"| {med['steps_per_s']:.1f} | {keep_fps} | {wait} |",
        flush=True,
    )


def measure(args: argparse.Namespace, s: dict, actors: int, mode: str, k: int) -> dict:
    """One setting: in process (0 actors), acting alone (``--acting-only``), or flat out and then
    keeping up at half the rows per gradient step that flat out delivered."""
    if actors == 0:
        r = in_process(s, args.seconds, args.prefill, k)
    elif args.acting_only:
        r = with_actors(
            s,
            actors,
            args.seconds,
            args.prefill,
            None,
            mode,
            learn=False,
            splits=k,
            deadline_ms=args.deadline_ms,
        )
    else:
        flat = with_actors(s, actors, args.seconds, args.prefill, None, mode, splits=k, deadline_ms=args.deadline_ms)
        rows_per_step = 0.5 * flat["fps"] / max(flat["steps_per_s"], 1e-9)
        keep = with_actors(
            s,
            actors,
            args.seconds,
            args.prefill,
            rows_per_step,
            mode,
            splits=k,
            deadline_ms=args.deadline_ms,
        )
        r = {**flat, "keep_fps": keep["fps"], "wait": keep["wait"]}
    return r


def bench_env(
    args: argparse.Namespace,
    name: str,
    ceilings: dict,
    modes: list[tuple[str, str, int]],
    in_process_modes: list[tuple[str, str, int]],
) -> None:
    """Every actor count and mode of env ``name``, ``--repeats`` times; each row printed once complete."""
    s = settings(name, args.backend, args.device, args.envs_per_actor)

    best = ceiling.ceiling(ceilings[name])

    rows: dict[tuple[int, str], list[dict]] = {}
    for repeat in range(args.repeats):  # the settings back to back, each repeat in turn
        for actors in [int(a) for a in args.actors.split(",")]:
            for label, mode, k in in_process_modes if actors == 0 else modes:
                r = measure(args, s, actors, mode, k)
                rows.setdefault((actors, label), []).append(r)
                if repeat == args.repeats - 1:  # each row as soon as it is complete: a cut run keeps it
                    report(name, s, best, actors, label, rows[(actors, label)])


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    ceilings = measure_ceilings(args)
    print_table_header()
    modes, in_process_modes = acting_modes(args)
    for name in args.envs.split(","):
        bench_env(args, name, ceilings, modes, in_process_modes)
    print(f"\nload average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
