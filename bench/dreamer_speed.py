"""Dreamer hot-path speed: seconds per gradient step (world model + actor + critic) and env
steps per second while acting, on vector CartPole.

    python bench/dreamer_speed.py                      # XS preset, batch 16x64, horizon 15
    python bench/dreamer_speed.py --threads 2 --steps 10 --deter 512 --hidden 512 --layers 2

The batch comes from a replay buffer prefilled with random CartPole episodes. One gradient
step runs exactly what ``Dreamer.training_step`` runs, minus Lightning's logging: the world
model loss; the imagined rollout; the actor and critic losses; one backward of their sum;
per-network gradient clipping and three Adam steps; the slow-critic update. Prints a
markdown table with the median (and min) wall-clock and process CPU seconds; the machine is
shared, so CPU time is the steadier number. Beside them (eager steps; ``--no-profile`` skips
them): the ops one step dispatches, its GFLOP and the sgemm floor measured in the same run
(``bench/learner_speed.py``'s measurements, which also profile compiled steps).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from learner_speed import dispatched_ops, dreamer_batch, matmul_floor, step_flops  # noqa: E402

from lightning_wm.agents.dreamer import BehaviorSettings, Dreamer, DreamerNet  # noqa: E402
from lightning_wm.envs import EnvConfig, env_spec, make_vector_env  # noqa: E402
from lightning_wm.runtime import keep_freed_memory  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=7, help="timed gradient steps (after 2 warm-up steps)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--horizon", type=int, default=15)
    parser.add_argument("--deter", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--stoch", type=int, default=32)
    parser.add_argument("--classes", type=int, default=32)
    parser.add_argument("--bins", type=int, default=255)
    parser.add_argument("--num-envs", type=int, default=4, help="envs stepped together while acting")
    parser.add_argument("--act-steps", type=int, default=300)
    parser.add_argument(
        "--replay-critic",
        type=float,
        default=0.0,
        help="behavior.replay_critic_weight (the critic's loss on the replayed sequences; 0: off)",
    )
    parser.add_argument("--compile", choices=["none", "cells", "step"], default="none", help="compile.mode")
    parser.add_argument("--no-profile", action="store_true", help="skip the op and FLOP counts and the sgemm floor")
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast (what --trainer.precision bf16-mixed does)")
    parser.add_argument(
        "--no-malloc-tuning",
        action="store_true",
        help="leave glibc's malloc defaults (large freed blocks go back to the OS)",
    )
    return parser.parse_args()


def time_steps(
    model: Dreamer, batch: Any, optimizers: Any, steps: int, autocast: torch.autocast
) -> tuple[list[float], list[float]]:
    """Wall-clock and process CPU seconds of ``steps`` gradient steps, after 2 warm-up steps."""
    wall, cpu = [], []
    for i in range(steps + 2):
        w0, c0 = time.perf_counter(), time.process_time()
        with autocast:
            model.gradient_step(batch, optimizers)
        if i >= 2:
            wall.append(time.perf_counter() - w0)
            cpu.append(time.process_time() - c0)
    return wall, cpu


def profile_columns(
    model: Dreamer,
    batch: Any,
    optimizers: Any,
    autocast: torch.autocast,
    bf16: bool,
    wall: list[float],
    cpu: list[float],
) -> str:
    """The table's profile columns: the ops one eager step dispatches, its FLOPs and the sgemm floor."""
    with autocast:
        ops, _ = dispatched_ops(lambda: model.gradient_step(batch, optimizers))
        flops, shapes = step_flops(lambda: model.gradient_step(batch, optimizers))
    floor, cpu_floor, _ = matmul_floor(shapes, flops, torch.bfloat16 if bf16 else torch.float32)
    wall_median, cpu_median = statistics.median(wall), statistics.median(cpu)
    return (
        f"| {ops} | {flops / 1e9:.1f} | {flops / 1e9 / wall_median:.0f} | {floor:.3f} "
        f"| {100 * floor / wall_median:.0f}% ({100 * cpu_floor / cpu_median:.0f}% of CPU s) "
    )


def acting_rate(model: Dreamer, cfg: EnvConfig, num_envs: int, act_steps: int) -> float:
    """Env steps per second on the collector's path (posterior filter + actor) on a real vector env."""
    env = make_vector_env(cfg)
    obs, _ = env.reset(seed=0)
    state = model.initial_state(num_envs)
    t0 = time.perf_counter()
    for _ in range(act_steps):
        action, state, _ = model.act(torch.as_tensor(obs), state, explore=True)
        obs, *_ = env.step(action.numpy())
    act_rate = act_steps * num_envs / (time.perf_counter() - t0)
    env.close()
    return act_rate


def print_table(
    args: argparse.Namespace, model: Dreamer, wall: list[float], cpu: list[float], profile: str, act_rate: float
) -> None:
    """The settings line, the markdown table, each step's wall time and the load average."""
    params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(
        f"Dreamer speed on CartPole-v1 vector obs, torch {torch.__version__}, {args.threads} thread(s), "
        f"{os.cpu_count()} CPUs, compile={args.compile}, bf16={args.bf16}, "
        f"malloc tuning={not args.no_malloc_tuning}"
    )
    print()
    print(
        "| preset | params | batch | horizon | replay critic | s/grad step (median) | min | CPU s/step (median) "
        + ("" if args.no_profile else "| ops/step | GFLOP/step | GFLOP/s | sgemm floor s | % of floor ")
        + "| env steps/s acting |"
    )
    print("| --- " * (9 if args.no_profile else 14) + "|")
    print(
        f"| deter {args.deter}, hidden {args.hidden}x{args.layers}, {args.stoch}x{args.classes}, {args.bins} bins "
        f"| {params / 1e6:.2f}M | {args.batch}x{args.length} | {args.horizon} | {args.replay_critic:g} "
        f"| {statistics.median(wall):.3f} "
        f"| {min(wall):.3f} | {statistics.median(cpu):.3f} {profile}| {act_rate:.0f} ({args.num_envs} envs) |"
    )
    print()
    print("wall per step:", " ".join(f"{w:.2f}" for w in wall))
    print("load average:", " ".join(f"{x:.2f}" for x in os.getloadavg()))


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    if not args.no_malloc_tuning:
        keep_freed_memory()
    torch.manual_seed(0)

    cfg = EnvConfig(id="CartPole-v1", num_envs=args.num_envs, seed=0)
    spec = env_spec(cfg)
    net = DreamerNet(
        deter=args.deter, hidden=args.hidden, layers=args.layers, stoch=args.stoch, classes=args.classes, bins=args.bins
    )
    behavior = BehaviorSettings(horizon=args.horizon, replay_critic_weight=args.replay_critic)
    model = Dreamer(spec, net=net, behavior=behavior, compile={"mode": args.compile})
    optimizers = model.configure_optimizers()
    batch = dreamer_batch(cfg, args.batch, args.length)

    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16)
    wall, cpu = time_steps(model, batch, optimizers, args.steps, autocast)

    profile = ""
    args.no_profile = args.no_profile or args.compile != "none"  # compiled steps: bench/learner_speed.py
    if not args.no_profile:  # ops dispatched by one step, its FLOPs (an eager step) and the sgemm floor
        profile = profile_columns(model, batch, optimizers, autocast, args.bf16, wall, cpu)

    # acting: the collector's path (posterior filter + actor) on a real vector env
    act_rate = acting_rate(model, cfg, args.num_envs, args.act_steps)
    print_table(args, model, wall, cpu, profile, act_rate)


if __name__ == "__main__":
    main()
