"""Learner-step speed of Dreamer, MuZero and IMPALA on CartPole: seconds per gradient step, the ops
one step dispatches, and its arithmetic beside the machine's own matrix-multiply rate.

    python bench/learner_speed.py --family dreamer                      # Dreamer XS, 1 thread
    OMP_NUM_THREADS=2 python bench/learner_speed.py --family dreamer --size S --threads 2 --steps 5
    python bench/learner_speed.py --family dreamer --compile step       # the compiled whole step
    python bench/learner_speed.py --family muzero --bf16                # bf16 autocast
    python bench/learner_speed.py --family impala --compile step
    python bench/learner_speed.py --family dreamer --bf16-ratio      # fp32 and bf16 steps interleaved

One gradient step is what the family's ``training_step`` runs, minus Lightning's bookkeeping:
the losses, one backward, gradient clipping, the optimizer step(s) (Dreamer: its three and the
slow critic; MuZero: the reanalysing targets, the unrolled model, then the step and the target
network's update). Printed, as one markdown row:

* **s/step**: the median (and min) wall seconds over ``--steps`` steps after the warm-up steps
  (the first step's seconds, with ``--compile``, include the compilation: printed apart);
* **ops/step**: the kernels one step dispatches (``torch.profiler`` on the CPU: aten ops that
  run a kernel themselves — not views, and no kernel-running op below them — plus compiled
  kernels), and in brackets every aten op event — the launch count a GPU step would pay;
* **GFLOP/step** (``torch.utils.flop_counter.FlopCounterMode`` over one eager step) and the
  achieved GFLOP/s;
* **floor**: the seconds the step's matrix multiplies alone would take at the rate ``torch.mm``
  reaches here, timed in the same run at the step's dominant shapes (those carrying 90% of the
  multiply FLOPs, at most 6) with the same thread count and dtype (bf16 with ``--bf16``);
  **% of floor** = floor / s per step. Both per wall second and per process CPU second: on a
  shared machine the CPU seconds are the steadier ratio.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from lightning_wm.compiling import CompileSettings  # noqa: E402
from lightning_wm.envs import EnvConfig, env_spec  # noqa: E402
from lightning_wm.optim import split_lr_schedule  # noqa: E402
from lightning_wm.runtime import keep_freed_memory  # noqa: E402

#: Dreamer sizes (deter, hidden, layers) of the issue's table.
DREAMER_SIZES = {"XS": (256, 256, 1), "S": (512, 512, 2), "M": (1024, 640, 3), "L": (2048, 768, 4)}
MATMULS = ("mm", "addmm", "bmm", "baddbmm")

Step = Callable[[], Any]


# -- the families' gradient steps --------------------------------------------------------------------
def on_device(batch: dict[str, Any], device: str) -> dict[str, Any]:
    """The batch's tensors on ``device``."""
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def dreamer_batch(cfg: EnvConfig, batch: int, length: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """``[B, L]`` sequences from a replay buffer prefilled with random-policy CartPole rows."""
    from lightning_wm.data.collector import Collector
    from lightning_wm.data.replay import ReplayBuffer
    from lightning_wm.data.samplers import SequenceSampler
    from lightning_wm.envs import make_vector_env
    from lightning_wm.policies import RandomAgent

    spec = env_spec(cfg)
    buffer = ReplayBuffer(10_000, cfg.num_envs, seed=seed)
    env = make_vector_env(cfg)
    collector = Collector(env, RandomAgent(spec, seed=seed), buffer, seeds=seed, spec=spec)
    collector.collect(max(2 * length, 2_000 // cfg.num_envs))
    env.close()
    return SequenceSampler(length).sample(buffer, batch)


def dreamer_step(args: argparse.Namespace, compile: CompileSettings) -> tuple[Step, str, Any]:
    """Dreamer's gradient step on a ``[batch, length]`` CartPole batch at ``args.size``."""
    from lightning_wm.agents.dreamer import BehaviorSettings, Dreamer, DreamerNet, DreamerOptim

    cfg = EnvConfig(id="CartPole-v1", num_envs=4, seed=0)
    deter, hidden, layers = DREAMER_SIZES[args.size]
    net = DreamerNet(deter=deter, hidden=hidden, layers=layers)
    torch.manual_seed(0)
    kernels = getattr(args, "optim", "auto")
    optim = DreamerOptim(
        **{
            n: dataclasses.replace(getattr(DreamerOptim(), n), implementation=kernels)
            for n in ("model", "actor", "critic")
        }
    )
    behavior = BehaviorSettings(horizon=args.horizon)
    model = Dreamer(env_spec(cfg), net=net, behavior=behavior, optim=optim, compile=compile)
    model = model.to(args.device)
    optimizers = model.configure_optimizers()
    batch = on_device(dreamer_batch(cfg, args.batch, args.length), args.device)
    label = (
        f"Dreamer {args.size} (deter {deter}, {hidden}x{layers}), batch {args.batch}x{args.length}, H {args.horizon}"
    )
    return (lambda: model.gradient_step(batch, optimizers)), label, model


def training_step(model: Any, batch: Any, after: Callable[[], None] | None = None) -> Step:
    """One optimizer step as the learner's ``training_step`` runs it (loss, backward, the module's
    gradient clipping, the step) on a fixed ``batch``; ``after`` runs once the weights changed."""
    optimizer, _ = split_lr_schedule(model.configure_optimizers())

    def step() -> None:
        loss = model.training_step(batch, 0)["loss"]
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        model.configure_gradient_clipping(optimizer)
        optimizer.step()
        if after is not None:
            after()

    return step


def muzero_step(args: argparse.Namespace, compile: CompileSettings) -> tuple[Step, str, Any]:
    """MuZero's gradient step at ``configs/muzero/cartpole.yaml``'s sizes (25 simulations of
    reanalysis, unroll 5) on a batch of ``args.batch`` windows acted by the model itself."""
    from lightning_wm.agents.muzero import MuZero, MuZeroNet
    from lightning_wm.data.modules import ReplayDataModule
    from lightning_wm.optim import OptimSettings
    from lightning_wm.search import SearchSettings

    torch.manual_seed(0)
    net = MuZeroNet(latent_dim=64, hidden=64, layers=2, head_hidden=32, support_size=25, projection=(256, 256, 128))
    model = MuZero(
        env_spec(EnvConfig("CartPole-v1")),
        net=net,
        search=SearchSettings(num_simulations=25, unvisited_q="mean"),
        loss={"value_weight": 0.25, "train_repr_prediction": True, "repr_weight": 2.0},
        optim=OptimSettings(lr=3e-3, weight_decay=1e-4, implementation=args.optim),
        compile=compile,
    )
    model.log = model.log_dict = lambda *a, **k: None  # training_step outside a Trainer
    dm = ReplayDataModule(
        EnvConfig("CartPole-v1", num_envs=8, seed=0), batch_size=args.batch, sampler=model.replay_sampler(), prefill=0
    )
    dm.setup("fit")
    dm.collector.set_agent(model)
    dm.collector.collect(40)
    batch = on_device(dm.sample_batch(), args.device)
    model = model.to(args.device)
    return (
        training_step(model, batch, after=lambda: model.update_target(1)),
        f"MuZero CartPole config (latent 64, 25 simulations), batch {args.batch}",
        model,
    )


def impala_step(args: argparse.Namespace, compile: CompileSettings) -> tuple[Step, str, Any]:
    """IMPALA's gradient step at ``configs/impala/cartpole.yaml``'s sizes on a batch of
    ``args.batch`` unrolls of 8 steps acted in process."""
    from lightning_wm.agents.impala import IMPALA
    from lightning_wm.data.modules import UnrollDataModule
    from lightning_wm.nn.actor_critic import ActorCriticSettings
    from lightning_wm.optim import GradClipSettings, OptimSettings

    torch.manual_seed(0)
    dm = UnrollDataModule(EnvConfig("CartPole-v1", num_envs=args.batch, seed=0), unroll_length=8, batch_size=args.batch)
    optim = OptimSettings(lr=0.002, clip=GradClipSettings(type="clip_norm", value=40.0), implementation=args.optim)
    model = IMPALA(dm.spec, net=ActorCriticSettings(hidden=64, layers=2), optim=optim, compile=compile)
    model.log = model.log_dict = lambda *a, **k: None
    dm.setup("fit")
    dm.attach_agent(model, 0)
    try:
        batch = dm.next_batch()
    finally:
        dm.teardown("fit")
    batch = on_device(batch, args.device)
    model = model.to(args.device)
    return training_step(model, batch), f"IMPALA CartPole config (64x2), batch {args.batch}x8", model


FAMILIES = {"dreamer": dreamer_step, "muzero": muzero_step, "impala": impala_step}


# -- measurements ------------------------------------------------------------------------------------
class MatmulShapes(TorchDispatchMode):
    """FLOPs ``2 m k n`` of every matrix multiply dispatched, summed per ``(m, k, n)``."""

    def __init__(self) -> None:
        super().__init__()
        self.flops: collections.Counter[tuple[int, int, int]] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in MATMULS:
            a, b = (args[1], args[2]) if name.startswith(("addmm", "baddbmm")) else (args[0], args[1])
            batches = a.shape[0] if a.dim() == 3 else 1
            m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
            self.flops[(m, k, n)] += 2 * batches * m * k * n
        return func(*args, **(kwargs or {}))


def step_flops(step: Step) -> tuple[float, collections.Counter]:
    """Total FLOPs of one (eager) step and its matrix multiplies' FLOPs per shape."""
    from torch.utils.flop_counter import FlopCounterMode

    counter, shapes = FlopCounterMode(display=False), MatmulShapes()
    with counter, shapes:
        step()
    return float(counter.get_total_flops()), shapes.flops


#: aten ops that only make a view or read metadata (no kernel of their own)
NO_KERNEL = frozenset(
    "resolve_conj resolve_neg view _unsafe_view reshape _reshape_alias expand expand_as t transpose permute "
    "as_strided unsqueeze squeeze select slice narrow alias detach detach_ lift_fresh empty empty_like "
    "empty_strided unflatten flatten split split_with_sizes chunk unbind contiguous to _to_copy result_type "
    "size stride numel dim is_nonzero set_ view_as".split()
)


def dispatched_ops(step: Step, by_name: collections.Counter | None = None) -> tuple[int, int]:
    """``(kernels, aten op events)`` of one step under ``torch.profiler``. Kernels: the aten ops
    that run one themselves (not a view or metadata op, and no such op below them) plus compiled
    kernels (inductor's ``cpp_fused_*`` / ``triton_*`` calls, visible with kernel profiling on).
    A multi-tensor op (``_foreach_*``, ``_fused_*``: the optimizers' and the clipper's) counts as
    one, what it launches on CUDA; on the CPU it loops over its tensors, one op each, which the
    count leaves out. ``by_name`` (if given) counts the kernels by name, a kernel run inside another
    aten op named with it (``aten::copy_ in aten::addmm``), compiled kernels as one name."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    events = prof.events()
    memo: dict[int, bool] = {}

    def multi_tensor(event: Any) -> bool:
        return event.name.startswith(("aten::_foreach_", "aten::_fused_"))

    def inside_multi_tensor(event: Any) -> bool:
        parent = event.cpu_parent
        while parent is not None:
            if multi_tensor(parent):
                return True
            parent = parent.cpu_parent
        return False

    def runs_kernel(event: Any) -> bool:
        if id(event) not in memo:
            name = event.name
            if multi_tensor(event):
                memo[id(event)] = True
            elif "cpp_fused" in name or name.startswith("triton_"):
                memo[id(event)] = True
            elif not name.startswith("aten::") or name[6:] in NO_KERNEL:
                memo[id(event)] = False
            else:
                memo[id(event)] = not any(below(c) for c in event.cpu_children)
        return memo[id(event)]

    def below(event: Any) -> bool:  # a kernel at or under this event
        return runs_kernel(event) or any(below(c) for c in event.cpu_children)

    counted = [e for e in events if runs_kernel(e) and not inside_multi_tensor(e)]
    if by_name is not None:
        for e in counted:
            parent = e.cpu_parent
            if "cpp_fused" in e.name or e.name.startswith("triton_"):
                by_name["compiled kernels"] += 1
            else:
                by_name[f"{e.name} in {parent.name}" if parent is not None else e.name] += 1
    kernels = len(counted)
    return kernels, sum(e.name.startswith("aten::") for e in events)


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def mm_rate(
    m: int, k: int, n: int, dtype: torch.dtype, seconds: float = 0.3, device: str = "cpu"
) -> tuple[float, float]:
    """GFLOP/s of ``torch.mm([m, k], [k, n])`` here, per wall second and per process CPU second
    (medians of repeats lasting ``seconds``)."""
    a, b = torch.randn(m, k, device=device).to(dtype), torch.randn(k, n, device=device).to(dtype)
    torch.mm(a, b)
    wall, cpu = [], []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline or len(wall) < 5:
        synchronize(device)
        w0, c0 = time.perf_counter(), time.process_time()
        torch.mm(a, b)
        synchronize(device)
        wall.append(time.perf_counter() - w0)
        cpu.append(time.process_time() - c0)
    flop = 2 * m * k * n / 1e9
    return flop / statistics.median(wall), flop / max(statistics.median(cpu), 1e-9)


def matmul_floor(
    shapes: collections.Counter, total_flops: float, dtype: torch.dtype, most: int = 6, device: str = "cpu"
) -> tuple[float, float, list[str]]:
    """Seconds (wall, process CPU) the step's FLOPs take at ``torch.mm``'s rate here: each dominant
    shape (90% of the multiply FLOPs, at most ``most``) at its own rate, every other FLOP at the
    top shape's rate; and a description of the shapes."""
    mm_total = sum(shapes.values())
    chosen, covered = [], 0
    for shape, flops in shapes.most_common():
        if len(chosen) == most or covered >= 0.9 * mm_total:
            break
        chosen.append((shape, flops))
        covered += flops
    wall = cpu = 0.0
    described: list[str] = []
    top: tuple[float, float] | None = None
    for (m, k, n), flops in chosen:
        rate = mm_rate(m, k, n, dtype, device=device)
        top = top or rate
        wall, cpu = wall + flops / (rate[0] * 1e9), cpu + flops / (rate[1] * 1e9)
        described.append(f"[{m},{k}]@[{k},{n}] {100 * flops / mm_total:.0f}%: {rate[0]:.0f} GFLOP/s")
    if top:
        wall, cpu = wall + (total_flops - covered) / (top[0] * 1e9), cpu + (total_flops - covered) / (top[1] * 1e9)
    return wall, cpu, described


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=sorted(FAMILIES), default="dreamer")
    parser.add_argument("--size", choices=sorted(DREAMER_SIZES), default="XS", help="Dreamer's size")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=5, help="timed gradient steps (after the warm-up)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, default=None, help="Dreamer 16, MuZero 256, IMPALA 16")
    parser.add_argument("--length", type=int, default=64, help="Dreamer's sequence length")
    parser.add_argument("--horizon", type=int, default=15, help="Dreamer's imagination horizon")
    parser.add_argument("--compile", choices=["none", "cells", "step"], default="none")
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast (what --trainer.precision bf16-mixed does)")
    parser.add_argument("--no-profile", action="store_true", help="skip the op count and the FLOP count")
    parser.add_argument(
        "--bf16-ratio", action="store_true", help="alternate fp32 and bf16 autocast steps in one process; print both"
    )
    parser.add_argument(
        "--optim", choices=["auto", "for_loop", "foreach", "fused"], default="auto", help="optim.implementation"
    )
    parser.add_argument("--top", type=int, default=0, help="print the N most frequent kernels of the step")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (the profile counts CPU-side ops either way)")
    args = parser.parse_args()
    args.batch = args.batch or {"dreamer": 16, "muzero": 256, "impala": 16}[args.family]
    return args


def configure_torch(args: argparse.Namespace) -> None:
    """Threads, malloc tuning, the inductor cache, and (compiled) kernels in the profile's op count."""
    torch.set_num_threads(args.threads)
    keep_freed_memory()
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", "/tmp/torchinductor_lightning_wm")
    if args.compile != "none":
        import torch._inductor.config as inductor_config

        inductor_config.cpp.enable_kernel_profile = True  # compiled kernels show up in the op count


def timed_step(step: Step, device: str, autocast: torch.autocast) -> tuple[float, float]:
    """Wall and process CPU seconds of one step (the device synchronized before and after)."""
    synchronize(device)
    wall, cpu = time.perf_counter(), time.process_time()
    with autocast:
        step()
    synchronize(device)
    return time.perf_counter() - wall, time.process_time() - cpu


def print_bf16_ratio(args: argparse.Namespace, step: Step, label: str) -> None:
    """CPU seconds per step in fp32 and under bf16 autocast, interleaved so that both see the same load."""
    times: dict[bool, list[float]] = {False: [], True: []}
    for i in range(args.steps + 1):
        for bf16 in (False, True):
            start = time.process_time()
            with torch.autocast(torch.device(args.device).type, dtype=torch.bfloat16, enabled=bf16):
                step()
            if i:
                times[bf16].append(time.process_time() - start)
    fp32, bf16 = statistics.median(times[False]), statistics.median(times[True])
    print(
        f"{label}; {args.threads} thread(s): CPU s/step fp32 {fp32:.3f}, bf16 autocast {bf16:.3f}: {fp32 / bf16:.2f}×"
    )


#: the profile of one step: ops and aten ops dispatched, FLOPs, the matmul floor (wall and CPU s),
#: the dominant multiplies and the kernels by name (None and zeros with ``--no-profile``)
Profile = tuple[Any, Any, Any, float, float, list[str], collections.Counter | None]


def profile_step(args: argparse.Namespace, step: Step, autocast: torch.autocast) -> Profile:
    """The ops one step dispatches, the FLOPs of one eager step, and the matmul floor."""
    names: collections.Counter | None = None
    ops = aten = flops = None
    floor = cpu_floor = 0.0
    shapes_text: list[str] = []
    if not args.no_profile:
        with autocast:
            names = collections.Counter()
            ops, aten = dispatched_ops(step, names)
        eager_step = step if args.compile == "none" else FAMILIES[args.family](args, CompileSettings())[0]
        with autocast:
            flops, shapes = step_flops(eager_step)
        dtype = torch.bfloat16 if args.bf16 else torch.float32
        floor, cpu_floor, shapes_text = matmul_floor(shapes, flops, dtype, device=args.device)
    return ops, aten, flops, floor, cpu_floor, shapes_text, names


def print_table(
    args: argparse.Namespace, label: str, first: float, wall: list[float], cpu: list[float], profile: Profile
) -> None:
    """The settings line, the markdown row, the dominant multiplies (and kernels), and the per-step times."""
    ops, aten, flops, floor, cpu_floor, shapes_text, names = profile
    median, cpu_median = statistics.median(wall), statistics.median(cpu)
    name = f"{args.family} {args.size if args.family == 'dreamer' else ''}".strip()
    print(
        f"{label}; torch {torch.__version__}, {args.threads} thread(s), {os.cpu_count()} CPUs, "
        f"compile={args.compile}, bf16={args.bf16}, device={args.device}"
    )
    print()
    print(
        "| step | compile | bf16 | s/step median (min) | CPU s/step | first step s | ops/step | GFLOP/step | GFLOP/s "
        "| floor s (CPU s) | % of floor (CPU) |"
    )
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    row = f"| {name} | {args.compile} | {args.bf16} | {median:.3f} ({min(wall):.3f}) | {cpu_median:.3f} | {first:.1f} "
    if flops is None:
        print(row + "| | | | | |")
    else:
        print(
            row + f"| {ops} ({aten} aten) | {flops / 1e9:.3g} | {flops / 1e9 / median:.3g} "
            f"| {floor:.3g} ({cpu_floor:.3g}) | {100 * floor / median:.0f}% ({100 * cpu_floor / cpu_median:.0f}%) |"
        )
        print()
        print("dominant multiplies:", "; ".join(shapes_text))
        if args.top:
            print("kernels by name:", "; ".join(f"{n} {name}" for name, n in names.most_common(args.top)))
    print("wall per step:", " ".join(f"{w:.3f}" for w in wall), "| CPU per step:", " ".join(f"{c:.3f}" for c in cpu))
    print("load average:", " ".join(f"{x:.2f}" for x in os.getloadavg()))


def main() -> None:
    args = parse_args()
    configure_torch(args)

    step, label, _ = FAMILIES[args.family](args, CompileSettings(mode=args.compile))
    autocast = torch.autocast(torch.device(args.device).type, dtype=torch.bfloat16, enabled=args.bf16)

    if args.bf16_ratio:  # interleaved, so that both see the same load
        print_bf16_ratio(args, step, label)
        return

    first = timed_step(step, args.device, autocast)[0]
    for _ in range(args.warmup - 1):
        timed_step(step, args.device, autocast)
    times = [timed_step(step, args.device, autocast) for _ in range(args.steps)]
    wall, cpu = [w for w, _ in times], [c for _, c in times]
    profile = profile_step(args, step, autocast)
    print_table(args, label, first, wall, cpu, profile)


if __name__ == "__main__":
    main()
