"""Benchmark: World Models (V + M + C) on pixel CartPole-v1, the whole pipeline through the CLI.

Stages (each the CLI command README documents, run in-process in ``--workdir``):

1. ``record``  random-policy episodes (64x64x3 frames of the     configs/worldmodels/cartpole_pixels/record.yaml
               rendering cropped to the pole and cart)
2. ``fit`` V   the VAE                                            .../vision.yaml
3. ``convert`` every episode into V's latents                     .../vision.yaml --ckpt_path last
4. ``fit`` M   the MDN-RNN on the latents                         .../memory.yaml
5. ``fit`` C   CMA-ES in the real env, for the time the 30-minute  .../controller.yaml --trainer.max_time ...
               budget leaves (``--budget-minutes``, ``--reserve-minutes``; or ``--generations N``)
6. ``fit`` C   CMA-ES inside M's dream (DreamEnv)                 .../controller.yaml --model.init_args.train_in dream
7. iterate    the paper's iterative training, ``--rounds`` times: ``record`` episodes with the
              latest dream-trained controller (``explore_noise``), ``convert`` the whole store,
              ``fit`` M on it, ``fit`` C inside the new M's dream (the controller never learns
              from the real env: it only supplies frames for M); with ``--round-ensemble N`` the
              dream is the new M together with the Ms of the N rounds before it

and prints per stage the wall time and its figure: V's held-out reconstruction MSE (per
pixel value on the [0, 1] scale), M's held-out NLL (nats per latent dimension), and each
controller's mean ± std return over ``--eval-episodes`` real episodes (one episode per env,
run to the end: no bias towards short episodes).

    python bench/worldmodels_cartpole.py                  # the full run
    python bench/worldmodels_cartpole.py --quick          # a minutes-long smoke run (numbers meaningless)
    python bench/worldmodels_cartpole.py --stages controller,dream   # reuse earlier stages in --workdir
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CONFIGS = ROOT / "configs" / "worldmodels" / "cartpole_pixels"
STAGES = ("record", "vision", "convert", "memory", "controller", "dream", "iterate")


def add_pipeline_args(p: argparse.ArgumentParser) -> None:
    """The work folder and stages; the sizes of the recording, V and M; the real-env controller's budget and CMA-ES."""
    p.add_argument("--workdir", default="bench_runs/worldmodels_cartpole")
    p.add_argument("--stages", default=",".join(STAGES), help="comma-separated subset of " + ",".join(STAGES))
    p.add_argument("--episodes", type=int, default=600, help="random episodes recorded")
    p.add_argument("--vision-epochs", type=int, default=4)
    p.add_argument("--memory-epochs", type=int, default=10)
    p.add_argument("--memory-batches", type=int, default=100, help="M training batches per epoch")
    p.add_argument(
        "--generations",
        type=int,
        default=None,
        help="CMA-ES generations in the real env (default: as many as --budget-minutes leaves, at most 1000)",
    )
    p.add_argument(
        "--budget-minutes",
        type=float,
        default=30.0,
        help="whole-pipeline budget: the real-env controller gets what the stages before it left, "
        "minus --reserve-minutes (Lightning's max_time)",
    )
    p.add_argument(
        "--reserve-minutes",
        type=float,
        default=3.0,
        help="kept back from the budget for the controller's evaluation and the dream stage",
    )
    p.add_argument(
        "--controller-minutes",
        type=float,
        default=None,
        help="wall-clock limit of the real-env controller, instead of the one from the budget",
    )
    p.add_argument("--dream-generations", type=int, default=30, help="CMA-ES generations inside the dream")
    p.add_argument("--popsize", type=int, default=16)
    p.add_argument(
        "--episodes-per-member",
        type=int,
        default=1,
        help="real episodes per member (1: more generations for the time; all members share the seed)",
    )


def add_dream_args(p: argparse.ArgumentParser) -> None:
    """The controller trained inside M's dream: CMA-ES and the dream's episodes, ends, starts and run folder."""
    p.add_argument("--dream-episodes-per-member", type=int, default=8)
    p.add_argument("--dream-temperature", type=float, default=1.0)
    p.add_argument(
        "--dream-sample-z",
        action="store_true",
        help="the dream-trained controller sees z sampled from V's posterior in the real env "
        "(as M's training targets were) instead of V's mean",
    )
    p.add_argument(
        "--dream-done-threshold",
        type=float,
        default=0.5,
        help="a dream episode ends where M's done probability exceeds this",
    )
    p.add_argument(
        "--dream-done-mode",
        choices=("threshold", "sample"),
        default="threshold",
        help="end a dream where p > threshold, or by a Bernoulli draw of p",
    )
    p.add_argument(
        "--dream-starts",
        choices=("first", "all"),
        default="first",
        help="dreams start at the recorded episodes' first rows, or at any row (M warmed up on the prefix)",
    )
    p.add_argument(
        "--dream-max-steps",
        type=int,
        default=500,
        help="a dream episode is truncated after this many steps (M's memory is reliable for as long as "
        "the sequences it was trained on)",
    )
    p.add_argument(
        "--dream-run-name",
        default="worldmodels-cartpole_pixels-controller-dream",
        help="run folder of the dream stage (several dream experiments side by side)",
    )
    p.add_argument("--dream-seed", type=int, default=0, help="CMA-ES seed of the dream stage")


def add_memory_args(p: argparse.ArgumentParser) -> None:
    """M's window, batch size and extra settings, the dream-trained controller's extra settings, and ensembles of Ms."""
    p.add_argument(
        "--memory-sequence-length",
        type=int,
        default=None,
        help="M's training window (the config's 32 by default); a dream runs M for as long as the "
        "episode, so longer windows (with recorded episodes that long) keep its state in range",
    )
    p.add_argument("--memory-batch-size", type=int, default=None, help="M's batch size (the config's 32 by default)")
    p.add_argument(
        "--memory-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an extra M setting (model.init_args.KEY), e.g. sample_z=false or loss.open_loop_weight=1; repeatable",
    )
    p.add_argument(
        "--dream-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an extra setting of the dream-trained controller (model.init_args.KEY, e.g. dream.max_starts=512); "
        "repeatable",
    )
    p.add_argument(
        "--ensemble",
        type=int,
        default=1,
        help="Ms per round: M (seed 0) and K-1 more with seeds 1..K-1 on the same latents, all of them "
        "dreaming together (the controller's dream.ensemble); 1: M alone",
    )
    p.add_argument(
        "--round-ensemble",
        type=int,
        default=0,
        help="iterate: each round's controller dreams in its new M together with the Ms of this many "
        "rounds before it (round 0: M on the first episodes), as the controller's dream.ensemble; "
        "0: the new M alone",
    )
    p.add_argument(
        "--dream-ensemble-next",
        choices=("random", "primary"),
        default="random",
        help="with --ensemble: z' from a member drawn per step, or from M",
    )
    p.add_argument(
        "--dream-ensemble-done",
        choices=("max", "mean"),
        default="max",
        help="with --ensemble: a dream step ends with the members' largest or mean done probability",
    )


def add_iterate_args(p: argparse.ArgumentParser) -> None:
    """The iterative training, the evaluation, the env's crop and action repeat, torch threads and --quick."""
    p.add_argument("--rounds", type=int, default=2, help="iterate: rounds of record -> M -> dream controller")
    p.add_argument("--round-episodes", type=int, default=100, help="iterate: episodes recorded per round")
    p.add_argument(
        "--warm-start",
        action="store_true",
        help="iterate: each round's CMA-ES starts from the last round's dream controller "
        "(init_params_ckpt) instead of zeros",
    )
    p.add_argument(
        "--explore-noise",
        type=float,
        default=0.1,
        help="iterate: probability of a random action while recording with the controller",
    )
    p.add_argument("--eval-episodes", type=int, default=20)
    p.add_argument(
        "--crop",
        type=int,
        nargs=4,
        default=None,
        metavar=("TOP", "LEFT", "HEIGHT", "WIDTH"),
        help="crop of the 400x600 rendering for every stage that plays the env (record, the "
        "controller's real env); the configs' [160, 0, 160, 600] by default",
    )
    p.add_argument(
        "--action-repeat",
        type=int,
        default=1,
        help="env steps per agent step for every stage that plays the env (record, the controller's "
        "real env); a dream step then stands for this many env steps",
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest for these small nets)")
    p.add_argument("--quick", action="store_true", help="tiny sizes: checks the pipeline, not the figures")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_pipeline_args(p)
    add_dream_args(p)
    add_memory_args(p)
    add_iterate_args(p)
    args = p.parse_args()
    if args.quick:
        args.episodes, args.vision_epochs, args.memory_epochs, args.memory_batches = 40, 1, 1, 20
        args.memory_sequence_length = 8
        args.generations, args.dream_generations, args.popsize, args.eval_episodes = 2, 2, 4, 4
        args.budget_minutes = 0.0
        args.episodes_per_member = args.dream_episodes_per_member = 1
    return args


def run(command: list[str]):
    from lightning_wm.cli import main

    return main(args=command)


QUIET = ["--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]
FRAMES = "data/worldmodels/cartpole_pixels/frames"
LATENTS = "data/worldmodels/cartpole_pixels/latents"
VISION_CKPT = "lightning_logs/worldmodels-cartpole_pixels-vision/checkpoints/last.ckpt"
MEMORY_RUN = "worldmodels-cartpole_pixels-memory"


def env_settings(args: argparse.Namespace) -> list[str]:
    """Overrides of the env that every stage playing it shares (V, M and C must see one crop and
    one action repeat)."""
    crop = ["--data.init_args.env.crop", "[" + ",".join(map(str, args.crop)) + "]"] if args.crop else []
    repeat = ["--data.init_args.env.action_repeat", str(args.action_repeat)] if args.action_repeat != 1 else []
    return crop + repeat


def settings(pairs: list[str]) -> list[str]:
    """``["k=v", ...]`` -> ``["--model.init_args.k", "v", ...]``."""
    out = []
    for pair in pairs:
        key, _, value = pair.partition("=")
        out += [f"--model.init_args.{key}", value]
    return out


def evaluate_real(model, env, episodes: int, seed: int = 900_000, use: str = "mean") -> tuple[float, float]:
    """Mean ± std return of the controller's ``use`` weights (the CMA-ES mean or the best member)
    over ``episodes`` real episodes of ``env`` (the controller config's env: same frame size and
    crop as V was trained on)."""
    import dataclasses

    import torch

    env = dataclasses.replace(env, seed=seed, num_envs=1)
    model.eval()
    with torch.no_grad():
        params = model.params if use == "mean" else model.best_params
        returns = model.evaluate_population(
            params.detach()[None], episodes, seed, where="real", config=env, per_episode=True
        )[0]
    model.close_envs()
    return float(returns.mean()), float(returns.std(unbiased=False))


def select_stages(args: argparse.Namespace) -> list[str]:
    """The stages of ``--stages``, in the order given; an unknown one ends the run."""
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    unknown = set(stages) - set(STAGES)
    if unknown:
        raise SystemExit(f"unknown stages {sorted(unknown)}; choose from {STAGES}")
    return stages


def prepare_workdir(args: argparse.Namespace, stages: list[str]) -> Path:
    """Create ``--workdir``, change into it, and clear the outputs of the stages that run again."""
    work = Path(args.workdir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    os.chdir(work)
    if "record" in stages:  # a fresh pipeline: clear this bench's own outputs
        for sub in ("data", "lightning_logs"):
            shutil.rmtree(work / sub, ignore_errors=True)
    if "convert" in stages:
        shutil.rmtree(work / "data/worldmodels/cartpole_pixels/latents", ignore_errors=True)
    runs = {
        "vision": "worldmodels-cartpole_pixels-vision",
        "memory": "worldmodels-cartpole_pixels-memory",
        "controller": "worldmodels-cartpole_pixels-controller",
        "dream": args.dream_run_name,
    }
    for name, run_name in runs.items():  # a re-run stage starts from scratch, not from its last checkpoint
        if name in stages:
            shutil.rmtree(work / "lightning_logs" / run_name, ignore_errors=True)
    return work


def record(args: argparse.Namespace) -> str:
    """Stage 1: random-policy episodes."""
    run(["record", "--config", str(CONFIGS / "record.yaml"), "--episodes", str(args.episodes), *env_settings(args)])
    from lightning_wm.data.episodes import EpisodeStore

    store = EpisodeStore("data/worldmodels/cartpole_pixels/frames")
    return f"{len(store)} episodes, {store.total_steps()} frames"


def vision(args: argparse.Namespace) -> str:
    """Stage 2: fit V, the VAE."""
    cli = run(
        ["fit", "--config", str(CONFIGS / "vision.yaml"), *QUIET, "--trainer.max_epochs", str(args.vision_epochs)]
    )
    m = cli.trainer.callback_metrics
    return f"val recon MSE {float(m['val/mse']):.5f} per pixel value, KL {float(m['val/kl']):.1f} nats"


def convert(target: str = LATENTS) -> str:
    """Stage 3: every episode into V's latents, in ``target``."""
    run(["convert", "--config", str(CONFIGS / "vision.yaml"), "--ckpt_path", "last", "--target", target])
    return "latent store written"


def memory(args: argparse.Namespace, work: Path, latents: str = LATENTS, run_name: str = MEMORY_RUN) -> str:
    """Stage 4: fit M on ``latents`` (and ``--ensemble``'s further members, other seeds)."""
    figures = []
    for k in range(args.ensemble):  # M, then the ensemble's further members (other seeds)
        name = run_name if k == 0 else f"{run_name}-s{k}"
        if k:
            shutil.rmtree(work / "lightning_logs" / name, ignore_errors=True)
        cli = run(
            [
                "fit",
                "--config",
                str(CONFIGS / "memory.yaml"),
                *QUIET,
                "--seed_everything",
                str(k),
                "--trainer.max_epochs",
                str(args.memory_epochs),
                "--trainer.run_name",
                name,
                "--data.init_args.directory",
                latents,
                "--data.init_args.train_batches",
                str(args.memory_batches),
                *(
                    ["--data.init_args.sequence_length", str(args.memory_sequence_length)]
                    if args.memory_sequence_length
                    else []
                ),
                *(["--data.init_args.batch_size", str(args.memory_batch_size)] if args.memory_batch_size else []),
                *settings(args.memory_set),
            ]
        )
        m = cli.trainer.callback_metrics
        figures.append(
            f"val NLL {float(m['val/nll']):.3f} nats/dim, done BCE {float(m['val/done_loss']):.3f} "
            f"(acc {float(m['val/done_acc']):.3f})"
        )
    return figures[0] if len(figures) == 1 else "; ".join(f"M{k}: {f}" for k, f in enumerate(figures))


def real_env_limit(args: argparse.Namespace, total: float) -> tuple[int, str]:
    """The real-env controller's generations and its time limit (Lightning's ``max_time``, "" for
    none): ``--controller-minutes``, or what the budget leaves since ``total`` (the pipeline's start)."""
    limit = ""
    minutes = args.controller_minutes
    if minutes is None and args.generations is None and args.budget_minutes > 0:
        minutes = args.budget_minutes - (time.time() - total) / 60 - args.reserve_minutes
    generations = args.generations or 1000
    if minutes is not None:
        if minutes <= 0:
            raise SystemExit(f"no time left for the controller in a {args.budget_minutes}-minute budget")
        seconds = int(minutes * 60)
        limit = f"00:{seconds // 3600:02d}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"
    return generations, limit


def dream_settings(
    args: argparse.Namespace, memory_run: str, latents: str, run_name: str | None, members: list[str] | None
) -> list[str]:
    """The overrides of a controller trained in M's dream (with ``members`` dreaming beside
    ``memory_run``; default: ``--ensemble``'s seeds)."""
    command = [
        "--trainer.run_name",
        run_name or args.dream_run_name,
        "--model.init_args.train_in",
        "dream",
        "--model.init_args.dream.starts",
        args.dream_starts,
        "--model.init_args.dream.max_steps",
        str(args.dream_max_steps),
        "--model.init_args.dream.done_mode",
        args.dream_done_mode,
        "--model.init_args.es.seed",
        str(args.dream_seed),
        "--model.init_args.dream.dir",
        latents,
        "--model.init_args.dream.temperature",
        str(args.dream_temperature),
        "--model.init_args.dream.done_threshold",
        str(args.dream_done_threshold),
        "--model.init_args.sample_z",
        str(args.dream_sample_z).lower(),
        "--model.init_args.es.episodes_per_member",
        str(args.dream_episodes_per_member),
        *settings(args.dream_set),
    ]
    if members is None:
        members = [f"{memory_run}-s{k}" for k in range(1, args.ensemble)]
    if members:
        paths = [f"lightning_logs/{name}/checkpoints/last.ckpt" for name in members]
        command += [
            "--model.init_args.dream.ensemble",
            "[" + ",".join(paths) + "]",
            "--model.init_args.dream.ensemble_next",
            args.dream_ensemble_next,
            "--model.init_args.dream.ensemble_done",
            args.dream_ensemble_done,
        ]
    return command


def controller(
    args: argparse.Namespace,
    total: float,
    dream: bool,
    memory_run: str = MEMORY_RUN,
    latents: str = LATENTS,
    run_name: str | None = None,
    start_from: str | None = None,
    members: list[str] | None = None,
) -> str:
    """Stages 5 and 6: fit C with CMA-ES in the real env or in M's dream, then evaluate it in the real env.
    ``members``: memory runs that dream beside ``memory_run`` (default: ``--ensemble``'s seeds)."""
    if dream:
        generations, limit = args.dream_generations, ""
    else:
        generations, limit = real_env_limit(args, total)
    command = [
        "fit",
        "--config",
        str(CONFIGS / "controller.yaml"),
        *QUIET,
        *env_settings(args),
        "--trainer.max_steps",
        str(generations),
        "--trainer.val_check_interval",
        str(10**6),
        "--model.init_args.es.popsize",
        str(args.popsize),
        "--model.init_args.memory_ckpt",
        f"lightning_logs/{memory_run}/checkpoints/last.ckpt",
    ]
    if limit:
        command += ["--trainer.max_time", limit]
    if start_from:
        command += ["--model.init_args.init_params_ckpt", start_from]
    if dream:
        command += dream_settings(args, memory_run, latents, run_name, members)
    else:
        command += ["--model.init_args.es.episodes_per_member", str(args.episodes_per_member)]
    fit_start = time.time()
    cli = run(command)
    m = cli.trainer.callback_metrics
    fit_seconds = time.time() - fit_start
    mean, std = evaluate_real(cli.model, cli.datamodule.env, args.eval_episodes)
    best_mean, best_std = evaluate_real(cli.model, cli.datamodule.env, args.eval_episodes, use="best")
    where = "dream" if dream else "real-env"
    return (
        f"{cli.trainer.global_step} generations{' (time limit ' + limit + ')' if limit else ''}; "
        f"last generation {where} fitness mean {float(m['fitness/mean']):.1f} best "
        f"{float(m['fitness/best']):.1f}; fit {fit_seconds:.0f} s; real return {mean:.1f} ± {std:.1f} "
        f"(CMA-ES mean), {best_mean:.1f} ± {best_std:.1f} (best member) over {args.eval_episodes} episodes"
    )


def iterate(args: argparse.Namespace, work: Path, total: float) -> str:
    """Stage 7: ``--rounds`` rounds of recording with the latest dream-trained controller, converting,
    fitting M on the whole store and fitting C inside the new M's dream."""
    from lightning_wm.data.episodes import EpisodeStore

    dream_run, memory_run = args.dream_run_name, MEMORY_RUN
    memory_runs = [MEMORY_RUN]  # round 0's M, then each round's
    figures = []
    for r in range(1, args.rounds + 1):
        run(
            [
                "record",
                "--config",
                str(CONFIGS / "record.yaml"),
                "--episodes",
                str(args.round_episodes),
                *env_settings(args),
                "--data.init_args.env.seed",
                str(1000 + r),
                "--model",
                "lightning_wm.agents.worldmodels.controller.Controller",
                "--model.init_args.vision_ckpt",
                VISION_CKPT,
                "--model.init_args.memory_ckpt",
                f"lightning_logs/{memory_run}/checkpoints/last.ckpt",
                "--model.init_args.explore_noise",
                str(args.explore_noise),
                "--ckpt_path",
                f"lightning_logs/{dream_run}/checkpoints/last.ckpt",
            ]
        )
        latents = f"{LATENTS}-round{r}"
        shutil.rmtree(latents, ignore_errors=True)
        convert(latents)
        last_controller = f"lightning_logs/{dream_run}/checkpoints/last.ckpt"
        memory_run, dream_run = f"{MEMORY_RUN}-round{r}", f"{args.dream_run_name}-round{r}"
        for name in (memory_run, dream_run):
            shutil.rmtree(work / "lightning_logs" / name, ignore_errors=True)
        m_figure = memory(args, work, latents, memory_run)
        earlier = memory_runs[::-1][: args.round_ensemble] if args.round_ensemble > 0 else None
        memory_runs.append(memory_run)
        c_figure = controller(
            args,
            total,
            True,
            memory_run,
            latents,
            dream_run,
            start_from=last_controller if args.warm_start else None,
            members=earlier,
        )
        store = EpisodeStore(FRAMES)
        figures.append(f"round {r}: {len(store)} episodes, {store.total_steps()} frames; M {m_figure}; C {c_figure}")
        print(f"\n--- {figures[-1]}\n", flush=True)
    return " || ".join(figures)


def print_table(args: argparse.Namespace, rows: list[tuple[str, float, str]], elapsed: float) -> None:
    """The markdown table: each stage's wall time and figure, then the total."""
    print("\n| stage | wall time (s) | figure |\n| --- | ---: | --- |")
    for name, seconds, figure in rows:
        print(f"| {name} | {seconds:.0f} | {figure} |")
    print(
        f"| total | {elapsed:.0f} | {'quick smoke settings' if args.quick else 'full settings'}, "
        f"{args.threads} torch thread(s) |"
    )


def main() -> None:
    args = parse_args()
    import torch

    torch.set_num_threads(args.threads)
    os.environ.setdefault("SDL_VIDEODRIVER", "dummy")
    stages = select_stages(args)
    work = prepare_workdir(args, stages)

    rows: list[tuple[str, float, str]] = []
    total = time.time()

    def stage(name: str, fn):
        start = time.time()
        figure = fn()
        rows.append((name, time.time() - start, figure))
        print(f"\n=== {name}: {rows[-1][1]:.0f} s  {figure}\n", flush=True)

    plan = {
        "record": lambda: record(args),
        "vision": lambda: vision(args),
        "convert": convert,
        "memory": lambda: memory(args, work),
        "controller": lambda: controller(args, total, False),
        "dream": lambda: controller(args, total, True),
        "iterate": lambda: iterate(args, work, total),
    }
    for name in STAGES:
        if name in stages:
            stage(name, plan[name])

    print_table(args, rows, time.time() - total)


if __name__ == "__main__":
    main()
