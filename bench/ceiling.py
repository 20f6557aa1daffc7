"""The env's own ceiling: random actions, no learner, on every core the run may use; prints a
markdown table.

For each env -- CartPole-v1, ALE/Pong-v5 through the Atari options ``atari_preprocessing: {}``
(84x84 gray, frame skip 4, up to 30 no-ops, sticky actions 0.25) and ``frame_stack: 4``, and
MinAtar's SpaceInvaders (its slowest game) and Breakout with IMPALA's 16 envs (``--envs
minatar,minatar_breakout``; ``pip install -e ".[minatar]"``) -- and each engine, as
``lightning_wm.envs.make_vector_env`` builds it:

* **gymnasium sync**: ``SyncVectorEnv``, every env in this one process (one core); for MinAtar the
  one-loop ``MinAtarVectorEnv`` (the same results), with gymnasium's **SyncVectorEnv** over the
  wrapped envs measured beside it;
* **gymnasium async**: ``AsyncVectorEnv``, one process per env, as many envs as cores;
* **EnvPool**: ``env.backend: envpool``, ``num_threads`` = cores (``pip install -e ".[envpool]"``);
* **EnvPool async**: the same envs in EnvPool's asynchronous mode (``send``/``recv`` of half the
  envs while the other half steps), which our vector env does not use: what the library can give.

it steps the vector env with random actions (drawn beforehand) for ``--seconds`` after a warm-up
and reports agent steps/s and frames/s (agent steps x frame skip: emulator frames for Pong). The
ceiling of an env is the best engine's rate; ``bench/actors.py`` prints each acting mode's rate as a
share of it.

    python bench/ceiling.py                     # CartPole and Pong, 10 s per engine
    python bench/ceiling.py --envs minatar,minatar_breakout --seconds 5
    python bench/ceiling.py --repeats 3         # the median of 3 rounds (a loaded machine)
    python bench/ceiling.py --envs pong --seconds 20
    python bench/ceiling.py --quick             # CartPole, 2 s per engine (a smoke run)
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import gymnasium as gym
from benchlib import unshadow_minatar  # noqa: E402  (this folder is first on the path when run as a script)

unshadow_minatar(__file__)  # bench/minatar.py must not shadow the minatar package
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lightning_wm.envpool_backend import envpool_options, usable_cores  # noqa: E402
from lightning_wm.envs import AtariPreprocessingConfig, EnvConfig, gymnasium_vector_env, make_vector_env  # noqa: E402

#: env name -> (env settings, frames per agent step, envs of the one-process and EnvPool engines)
ENVS: dict[str, tuple[EnvConfig, int, int]] = {
    "cartpole": (EnvConfig("CartPole-v1"), 1, 64),
    "pong": (EnvConfig("ALE/Pong-v5", atari_preprocessing=AtariPreprocessingConfig(), frame_stack=4), 4, 16),
    "minatar": (EnvConfig("MinAtar/SpaceInvaders-v1"), 1, 16),  # the slowest MinAtar game; IMPALA's 16 envs
    "minatar_breakout": (EnvConfig("MinAtar/Breakout-v1"), 1, 16),
}
ENGINES = ("gymnasium sync", "gymnasium async", "EnvPool", "EnvPool async")
WRAPPED_SYNC = "SyncVectorEnv"  # gymnasium's own over the wrapped envs, where make_vector_env has its own engine
#: the engines of the envs not measured with ENGINES: EnvPool has no MinAtar, and for MinAtar
#: ``gymnasium sync`` is the one-loop MinAtarVectorEnv, so gymnasium's own SyncVectorEnv over the
#: wrapped envs is measured beside it
ENV_ENGINES = {
    "minatar": ("gymnasium sync", "gymnasium async", WRAPPED_SYNC),
    "minatar_breakout": ("gymnasium sync", "gymnasium async", WRAPPED_SYNC),
}


def engine_config(env: EnvConfig, engine: str, num_envs: int, cores: int) -> EnvConfig:
    """``env`` as ``engine`` steps it: the backend, the vectorization and the number of envs."""
    if engine in ("gymnasium sync", WRAPPED_SYNC):
        return dataclasses.replace(env, num_envs=num_envs, vectorization="sync")
    if engine == "gymnasium async":
        return dataclasses.replace(env, num_envs=cores, vectorization="async")
    if engine in ("EnvPool", "EnvPool async"):
        return dataclasses.replace(env, num_envs=max(num_envs, 2 * cores), backend="envpool")
    raise ValueError(f"unknown engine {engine!r}; choose one of {(*ENGINES, WRAPPED_SYNC)}")


def steps_per_second(config: EnvConfig, seconds: float, warmup: int = 20, wrapped: bool = False) -> float:
    """Agent steps per second (summed over envs) of ``config``'s vector env under random actions
    (``wrapped``: gymnasium's own over the wrapped envs, ``gymnasium_vector_env``, whatever
    ``make_vector_env`` gives)."""
    env = gymnasium_vector_env(config) if wrapped else make_vector_env(config)
    try:
        env.reset(seed=[config.seed + i for i in range(config.num_envs)])
        env.action_space.seed(config.seed)
        actions = [env.action_space.sample() for _ in range(64)]
        for t in range(warmup):
            env.step(actions[t % 64])
        steps, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            env.step(actions[steps % 64])
            steps += 1
        return steps * config.num_envs / (time.perf_counter() - start)
    finally:
        env.close()


def envpool_async_steps_per_second(config: EnvConfig, cores: int, seconds: float, warmup: int = 20) -> float:
    """Agent steps per second of EnvPool in its asynchronous mode: each ``recv`` returns the first
    half of the envs to finish their step and ``send`` gives them their next actions while the
    other half still steps (``batch_size = num_envs / 2``, ``num_threads`` = cores)."""
    import envpool

    task, options = envpool_options(config)
    batch = config.num_envs // 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        pool = envpool.make(
            task,
            env_type="gymnasium",
            num_envs=config.num_envs,
            batch_size=batch,
            num_threads=min(cores, config.num_envs),
            seed=config.seed,
            **options,
        )
        pool.observation_space  # noqa: B018 - built here, its warnings silenced
        space = gym.vector.utils.batch_space(pool.action_space, batch)
    try:
        space.seed(config.seed)
        actions = [space.sample() for _ in range(64)]
        pool.async_reset()
        for t in range(warmup):
            *_, info = pool.recv()
            pool.send(actions[t % 64], info["env_id"])
        steps, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            *_, info = pool.recv()
            pool.send(actions[steps % 64], info["env_id"])
            steps += 1
        return steps * batch / (time.perf_counter() - start)
    finally:
        pool.close()


def measure(name: str, seconds: float, cores: int | None = None, repeats: int = 1) -> list[dict]:
    """One row per engine for env ``name``: ``engine``, ``envs``, ``workers`` (processes or
    threads), ``steps_per_s`` (agent steps; the median of ``repeats`` rounds, the engines taking
    turns in each round), ``frames_per_s``. EnvPool is left out when it is not installed."""
    env, skip, num_envs = ENVS[name]
    cores = cores or usable_cores()
    engines = [
        e
        for e in ENV_ENGINES.get(name, ENGINES)
        if "EnvPool" not in e or importlib.util.find_spec("envpool") is not None
    ]
    configs = {engine: engine_config(env, engine, num_envs, cores) for engine in engines}
    rates: dict[str, list[float]] = {engine: [] for engine in engines}
    for _ in range(repeats):
        for engine in engines:
            if engine == "EnvPool async":
                rates[engine].append(envpool_async_steps_per_second(configs[engine], cores, seconds))
            else:
                wrapped = engine == WRAPPED_SYNC
                rates[engine].append(steps_per_second(configs[engine], seconds, wrapped=wrapped))
    rows = []
    for engine in engines:
        rate = float(statistics.median(rates[engine]))
        workers = {"gymnasium sync": "1 process", "gymnasium async": f"{cores} processes", WRAPPED_SYNC: "1 process"}
        workers = workers.get(engine, f"{min(configs[engine].num_envs, cores)} threads")
        rows.append(
            {
                "env": name,
                "engine": engine,
                "envs": configs[engine].num_envs,
                "workers": workers,
                "steps_per_s": rate,
                "frames_per_s": rate * skip,
            }
        )
    return rows


def ceiling(rows: list[dict]) -> float:
    """The best engine's agent steps/s."""
    return max(row["steps_per_s"] for row in rows)


def table(rows: list[dict]) -> str:
    """The rows as a markdown table; each env's best engine in bold."""
    lines = [
        "| env | engine | envs | on | agent steps/s | frames/s | of the ceiling |",
        "| --- | --- | ---: | --- | ---: | ---: | ---: |",
    ]
    for row in rows:
        best = ceiling([r for r in rows if r["env"] == row["env"]])
        share = row["steps_per_s"] / best
        mark = "**" if share == 1.0 else ""
        lines.append(
            f"| {row['env']} | {mark}{row['engine']}{mark} | {row['envs']} | {row['workers']} "
            f"| {row['steps_per_s']:,.0f} | {row['frames_per_s']:,.0f} | {100 * share:.0f}% |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--envs", default="cartpole,pong", help="comma-separated: " + ", ".join(ENVS))
    p.add_argument("--seconds", type=float, default=10.0, help="measured seconds per engine")
    p.add_argument("--repeats", type=int, default=1, help="rounds over the engines; each rate is their median")
    p.add_argument("--cores", type=int, default=None, help="cores to use (default: all this process may use)")
    p.add_argument("--quick", action="store_true", help="CartPole, 2 s per engine")
    args = p.parse_args()
    if args.quick:
        args.envs, args.seconds = "cartpole", 2.0
    cores = args.cores or usable_cores()
    print(f"machine: {os.cpu_count()} CPUs, {cores} usable, load average {os.getloadavg()[0]:.2f} at start\n")
    rows = [row for name in args.envs.split(",") for row in measure(name, args.seconds, cores, args.repeats)]
    print(table(rows))
    print(f"\nload average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
