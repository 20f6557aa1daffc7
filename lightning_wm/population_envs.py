"""``PopulationEnvs``: ``n`` single envs stepped together only where still running, optionally in worker
processes — the population's envs of evolution strategies (one episode per env, finished envs
cost nothing)."""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np

from lightning_wm.envs import EnvConfig, make_env

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
        for w in range(self.workers):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_env_worker, args=(child, config, len(range(w, n, self.workers))), daemon=True)
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
        for proc in self._procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.terminate()
        self.envs, self._conns, self._procs = [], [], []

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass


def _step(env: gym.Env, action: Any) -> tuple[np.ndarray, float, bool]:
    obs, reward, terminated, truncated, _ = env.step(action)
    return obs, float(reward), bool(terminated or truncated)


def _env_worker(conn: Any, config: EnvConfig, count: int) -> None:
    """Subprocess of :class:`PopulationEnvs`: owns ``count`` envs; answers ``reset``/``step`` batches
    with ``(True, results)`` or ``(False, message)``; exits on ``close``."""
    import signal

    # a forked worker inherits the parent's handlers (Lightning's SIGTERM handler only sets a
    # flag): restore the default so that terminate() at exit ends it, and leave Ctrl-C to the parent
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        envs = [make_env(config) for _ in range(count)]
    except Exception as e:  # reported at the first request
        envs, error = [], f"{type(e).__name__}: {e}"
    else:
        error = None
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
    for env in envs:
        env.close()
