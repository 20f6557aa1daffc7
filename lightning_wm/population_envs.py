"""``PopulationEnvs``: ``n`` single envs stepped together only where still running, optionally in worker
processes — the population's envs of evolution strategies (one episode per env, finished envs
cost nothing)."""

from __future__ import annotations

import atexit
import os
import time
import weakref
from typing import Any

import gymnasium as gym
import numpy as np

from lightning_wm.console import headless_rendering
from lightning_wm.envs import EnvConfig, make_env
from lightning_wm.signals import check_stop_between_batches, die_with_parent, ignore_stop_signals

__all__ = ["PopulationEnvs"]


class PopulationEnvs:
    """``n`` envs of ``config`` stepped together, only where still running (finished envs
    cost nothing: the population's vector env for one-episode-per-env evaluation).

    ``workers > 1`` runs the envs in that many subprocesses (env ``i`` in worker ``i %
    workers``), so rendering pixel frames -- most of a CartPole-pixels step -- uses every core;
    the results are the same as in-process envs for the same seeds and actions.
    """

    def __init__(self, config: EnvConfig, n: int, workers: int = 0) -> None:
        self.config, self.n = config, n
        self.workers = min(workers, n) if workers > 1 else 0
        self.envs: list[gym.Env] = []
        self._conns: list[Any] = []
        self._procs: list[Any] = []
        if not self.workers:
            self.envs = [make_env(config) for _ in range(n)]
            return
        import multiprocessing as mp

        ctx = mp.get_context()  # the platform's default, as gymnasium's AsyncVectorEnv (fork on Linux: no re-imports)
        headless_rendering()  # before any worker renders: SDL must install no signal handlers
        _POOLS.add(self)
        for w in range(self.workers):
            parent, child = ctx.Pipe()
            count = len(range(w, n, self.workers))
            proc = ctx.Process(target=_env_worker, args=(child, config, count, os.getpid()), daemon=True)
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)

    def __len__(self) -> int:
        return self.n

    def _ask(self, command: str, index: np.ndarray, payload: list[Any]) -> list[Any]:
        """Send ``(command, [(local env, item)...])`` to each worker owning some of ``index``;
        gather the answers back in ``index`` order."""
        jobs: dict[int, list[int]] = {}
        for k, i in enumerate(index):
            jobs.setdefault(int(i) % self.workers, []).append(k)
        for w, ks in jobs.items():
            self._conns[w].send((command, [(int(index[k]) // self.workers, payload[k]) for k in ks]))
        out: list[Any] = [None] * len(index)
        for w, ks in jobs.items():
            try:
                ok, answer = self._conns[w].recv()
            except (EOFError, OSError) as e:
                check_stop_between_batches()  # a signal to the whole group ended the worker too: that is the stop
                raise RuntimeError(
                    f"env worker {w} of {self.workers} died ({type(e).__name__}); "
                    f"set env_workers: 0 to step the envs in this process"
                ) from e
            if not ok:
                raise RuntimeError(f"env worker {w} failed: {answer}")
            for k, a in zip(ks, answer):
                out[k] = a
        return out

    def reset(self, seeds: list[int]) -> np.ndarray:
        """Reset every env (env ``i`` with ``seeds[i]``) -> observations ``[n, ...]``."""
        if self.workers:
            return np.stack(self._ask("reset", np.arange(self.n), [int(s) for s in seeds]))
        return np.stack([env.reset(seed=int(s))[0] for env, s in zip(self.envs, seeds)])

    def step(self, index: np.ndarray, actions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Step envs ``index [M]`` with ``actions [M, ...]`` -> ``(obs [M, ...], reward [M], done [M])``."""
        # a generation can take long: a scheduler's stop ends it between env steps (one process; under
        # DDP Lightning stops every rank at the same generation)
        check_stop_between_batches()
        if self.workers:
            results = self._ask("step", np.asarray(index), list(actions))
        else:
            results = [_step(self.envs[i], a) for i, a in zip(index, actions)]
        obs, rewards, dones = zip(*results)
        return np.stack(obs), np.asarray(rewards, np.float64), np.asarray(dones, bool)

    def close(self) -> None:
        for env in self.envs:
            env.close()
        for conn in self._conns:
            try:
                conn.send(("close", []))
            except (BrokenPipeError, OSError):
                pass
        deadline = time.monotonic() + 5.0
        for proc in self._procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        for proc in self._procs:
            if proc.is_alive():
                proc.terminate()
            proc.join(timeout=2.0)
            if proc.is_alive():  # a handler that swallowed SIGTERM: no worker outlives close()
                proc.kill()
                proc.join(timeout=2.0)
        for conn in self._conns:
            conn.close()
        self.envs, self._conns, self._procs = [], [], []
        _POOLS.discard(self)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass


def _step(env: gym.Env, action: Any) -> tuple[np.ndarray, float, bool]:
    obs, reward, terminated, truncated, _ = env.step(action)
    return obs, float(reward), bool(terminated or truncated)


def _close_all() -> None:
    """At exit, before multiprocessing joins its daemonic children: close every pool still open (a
    fit stopped by a signal never reaches the controller's ``on_fit_end``)."""
    for pool in list(_POOLS):
        try:
            pool.close()
        except Exception:  # noqa: BLE001 - exiting
            pass


_POOLS: weakref.WeakSet[PopulationEnvs] = weakref.WeakSet()
atexit.register(_close_all)  # registered after multiprocessing's own exit hook, so it runs first


def _env_worker(conn: Any, config: EnvConfig, count: int, parent_pid: int) -> None:
    """Subprocess of :class:`PopulationEnvs`: owns ``count`` envs; answers ``reset``/``step`` batches
    with ``(True, results)`` or ``(False, message)``; exits on ``close`` or when the parent dies.

    A forked worker inherits the parent's handlers (which only set a stop flag): SIGTERM is reset
    to the default so that ``terminate()`` ends it, SIGINT and SIGUSR1 sent to the whole group are
    left to the parent, and the kernel kills the worker when the parent dies (even by ``kill -9``).
    The handlers are set again after the first answer: env code that initialises SDL could install
    its own (it is told not to, ``SDL_NO_SIGNAL_HANDLERS``)."""
    die_with_parent(parent_pid)
    ignore_stop_signals()
    try:
        envs = [make_env(config) for _ in range(count)]
    except Exception as e:  # reported at the first request
        envs, error = [], f"{type(e).__name__}: {e}"
    else:
        error = None
    answered = False
    while True:
        try:
            command, items = conn.recv()
        except EOFError:
            break
        if command == "close":
            break
        if error is not None:
            conn.send((False, error))
            continue
        try:
            if command == "reset":
                answer = [envs[i].reset(seed=seed)[0] for i, seed in items]
            else:
                answer = [_step(envs[i], a) for i, a in items]
            conn.send((True, answer))
        except Exception as e:
            conn.send((False, f"{type(e).__name__}: {e}"))
        if not answered:  # the envs have rendered once: whatever they installed is replaced
            answered = True
            ignore_stop_signals()
    for env in envs:
        env.close()
