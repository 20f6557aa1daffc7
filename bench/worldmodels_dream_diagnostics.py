"""Why does (or doesn't) a controller trained in M's dream transfer to pixel CartPole? Measurements.

Given a trained V and M (and optionally controller checkpoints), on real episodes recorded here
with the true CartPole state beside every frame (``keep_state``):

1. **probe** — a small MLP from V's ``z`` (drawn from its posterior, as M's targets are) to the
   true cart position ``x`` and pole angle ``theta`` (held-out R^2 on V's mean): does ``z``
   encode the state, and a ruler for dreams in physical units;
2. **open loop** — M rolled out under the recorded actions from real states (its memory warmed
   up on the real prefix, or from a zero memory as a dream that starts there without one),
   per horizon ``k``: ``z`` error relative to ``z``'s variance (1.0 = no better than the mean
   frame), the probed ``theta`` / ``x`` error against the probe of the real frame, and the
   same for "the frame does not move";
3. **actions** — from real states, ``theta`` after ``k`` steps of always-left vs always-right
   in M (mode) and in the real physics (CartPole reset to the true state): does the dream
   respond to the controller at all;
4. **done head** — calibration on real rows (mean predicted probability per bin vs the
   frequency of termination), its recall of real terminations at the 0.5 threshold and its
   false alarms by how long M's memory has been running (rows since the episode start);
5. **controllers** — for each checkpoint: mean real return, mean dream return (starts at
   first rows and at all rows), and along its dreams the probed angle: how often a dream runs
   on with the pole past 12 degrees or the cart past 2.4 (what a controller can exploit); and
   how its real episodes end (pole angle, track edge or the 500-step limit);
6. **ensemble** (with ``--ensemble``: more Ms on the same latents) — the members'
   disagreement (std over members of the mixture's mean, averaged over ``z``'s dimensions) on
   the real episodes teacher-forced, along each controller's dreams, and along dreams under
   random actions: do the members disagree where a controller's dream leaves the data?

    python bench/worldmodels_dream_diagnostics.py --workdir bench_runs/wm \\
        --controller lightning_logs/worldmodels-cartpole_pixels-controller-dream/checkpoints/last.ckpt

Writes ``diagnostics.json`` into the workdir and prints tables.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import pickle
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.append(str(Path(__file__).resolve().parent))  # last: bench/minatar.py must not shadow minatar
from worldmodels_disagreement import build_ensemble, dream_disagreement, ensemble_section  # noqa: E402

DEFAULT_CROP = (160, 0, 160, 600)
THETA_LIMIT, X_LIMIT = 12 * 2 * np.pi / 360, 2.4  # CartPole-v1's termination


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", default="bench_runs/wm")
    p.add_argument("--vision", default="lightning_logs/worldmodels-cartpole_pixels-vision/checkpoints/last.ckpt")
    p.add_argument("--memory", default="lightning_logs/worldmodels-cartpole_pixels-memory/checkpoints/last.ckpt")
    p.add_argument("--latents", default="data/worldmodels/cartpole_pixels/latents", help="M's training store")
    p.add_argument("--controller", action="append", default=[], help="controller checkpoint(s) to score")
    p.add_argument(
        "--ensemble",
        action="append",
        default=[],
        help="a further M checkpoint (same latents, another seed): section 6, and the controllers "
        "dream with the ensemble; repeatable",
    )
    p.add_argument("--random-episodes", type=int, default=30)
    p.add_argument(
        "--balancer-episodes",
        type=int,
        default=8,
        help="episodes of a noisy hand-made balancer (a = [theta + 0.5 theta_dot > 0], 10%% random)",
    )
    p.add_argument("--horizon", type=int, default=30)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--dreams", type=int, default=64, help="dream episodes per controller and start mode")
    p.add_argument("--real-episodes", type=int, default=10, help="real episodes per controller")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--crop",
        type=int,
        nargs=4,
        default=list(DEFAULT_CROP),
        metavar=("TOP", "LEFT", "HEIGHT", "WIDTH"),
        help="the crop V was trained on (worldmodels_cartpole.py --crop)",
    )
    return p.parse_args()


# -- ground truth ------------------------------------------------------------------------


def record_truth(
    random_episodes: int, balancer_episodes: int, seed: int, crop: tuple[int, ...] = DEFAULT_CROP
) -> list[dict[str, np.ndarray]]:
    """Real pixel episodes with the true state: ``obs`` (uint8 frames), ``state [T, 4]``,
    ``action``, ``is_terminal`` (row convention) and ``policy``."""
    from lightning_wm.envs import EnvConfig, make_env

    env = make_env(EnvConfig(id="CartPole-v1", pixels=True, size=(64, 64), crop=crop, keep_state=True))
    rng = np.random.default_rng(seed)
    episodes = []
    for i in range(random_episodes + balancer_episodes):
        balancer = i >= random_episodes
        obs, _ = env.reset(seed=seed * 10_000 + i)
        frames, states, actions, terminal = [obs["image"]], [obs["state"]], [], [False]
        done = False
        while not done:
            s = states[-1]
            a = int(s[2] + 0.5 * s[3] > 0) if balancer and rng.random() > 0.1 else int(rng.integers(2))
            obs, _, term, trunc, _ = env.step(a)
            actions.append(a)
            frames.append(obs["image"])
            states.append(obs["state"])
            terminal.append(bool(term))
            done = term or trunc
        actions.append(0)
        episodes.append(
            {
                "obs": np.stack(frames),
                "state": np.stack(states),
                "action": np.array(actions),
                "is_terminal": np.array(terminal),
                "policy": "balancer" if balancer else "random",
            }
        )
    env.close()
    return episodes


def fit_probe(x: np.ndarray, y: np.ndarray, steps: int = 3000, seed: int = 0):
    """An MLP ``[N, Z] -> [N, D]`` (2 x 128 tanh units, Adam on standardised targets); returns a
    numpy function ``[..., Z] -> [..., D]``."""
    import torch

    torch.manual_seed(seed)
    mx, sx, my, sy = x.mean(0), x.std(0) + 1e-6, y.mean(0), y.std(0) + 1e-6
    xt, yt = torch.as_tensor((x - mx) / sx).float(), torch.as_tensor((y - my) / sy).float()
    net = torch.nn.Sequential(
        torch.nn.Linear(x.shape[1], 128),
        torch.nn.Tanh(),
        torch.nn.Linear(128, 128),
        torch.nn.Tanh(),
        torch.nn.Linear(128, y.shape[1]),
    )
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        i = torch.randint(len(xt), (256,), generator=g)
        loss = (net(xt[i]) - yt[i]).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()

    def probe(z: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return net(torch.as_tensor((np.asarray(z) - mx) / sx).float()).numpy() * sy + my

    return probe


def r2(pred: np.ndarray, y: np.ndarray) -> np.ndarray:
    return 1 - ((pred - y) ** 2).mean(0) / y.var(0)


# -- measurements -------------------------------------------------------------------------


def cat(es: list[dict], k: str) -> np.ndarray:
    """Key ``k`` of the episodes ``es``, concatenated."""
    return np.concatenate([e[k] for e in es])


def truth_episodes(args: argparse.Namespace, crop: tuple[int, ...]) -> list[dict]:
    """The real episodes with the true state: the workdir's cache of them, or recorded (and cached)."""
    cache = Path(
        f"truth_{args.random_episodes}_{args.balancer_episodes}_{args.seed}"
        f"{'' if crop == DEFAULT_CROP else '_crop' + '_'.join(map(str, crop))}.pkl"
    )
    if cache.is_file():  # the same real episodes for every V and M measured in this workdir
        episodes = pickle.loads(cache.read_bytes())
    else:
        episodes = record_truth(args.random_episodes, args.balancer_episodes, args.seed, crop)
        cache.write_bytes(pickle.dumps(episodes))
    return episodes


def encode_episodes(model: Any, episodes: list[dict], t0: float) -> None:
    """V's posterior of every frame and M's memory along every episode; print the episodes' lengths."""
    from lightning_wm.agents.worldmodels.vision import encode_frames

    for e in episodes:
        mu, logvar = encode_frames(model.vision, e["obs"])
        e["mu"], e["logvar"] = mu.numpy(), logvar.numpy()
        e["post"] = model.posterior_states(e)  # z_t = mu_t, M's memory of the rows before t
    lengths = {p: [len(e["action"]) for e in episodes if e["policy"] == p] for p in ("random", "balancer")}
    print(
        f"recorded {len(episodes)} real episodes in {time.time() - t0:.0f} s; lengths: random mean "
        f"{np.mean(lengths['random']):.1f}, balancer mean {np.mean(lengths['balancer']):.1f}"
    )


def fit_state_probe(args: argparse.Namespace, episodes: list[dict], report: dict) -> tuple[Callable, float]:
    """1. probe: V's z -> (x, theta), scored on held-out episodes; returns the probe (the episodes'
    ``probed`` set) and the total variance of V's mean."""
    # 1. probe: mu -> (x, theta), fit on half the episodes of each policy, scored on the rest
    train = [e for i, e in enumerate(episodes) if i % 2 == 0]
    test = [e for i, e in enumerate(episodes) if i % 2 == 1]
    # fit on z drawn from V's posterior (what M is trained to predict), so that the probe reads the
    # dimensions that carry the frame and ignores those that are only posterior noise
    rng = np.random.default_rng(args.seed)
    draws = [
        cat(train, "mu") + np.exp(0.5 * cat(train, "logvar")) * rng.standard_normal(cat(train, "mu").shape)
        for _ in range(4)
    ]
    probe = fit_probe(np.concatenate(draws), np.tile(cat(train, "state")[:, [0, 2]], (4, 1)))
    held_out = probe(cat(test, "mu"))
    score = r2(held_out, cat(test, "state")[:, [0, 2]])
    probe_err = np.abs(held_out - cat(test, "state")[:, [0, 2]]).mean(0)
    report["probe"] = {
        "r2_x": float(score[0]),
        "r2_theta": float(score[1]),
        "err_x": float(probe_err[0]),
        "err_theta_deg": float(np.degrees(probe_err[1])),
    }
    print(
        f"\n1. probe mu -> state, held out: R^2 x {score[0]:.3f}, theta {score[1]:.3f}; mean |error| x "
        f"{probe_err[0]:.3f}, theta {np.degrees(probe_err[1]):.2f} deg"
    )
    for e in episodes:
        e["probed"] = probe(e["mu"])
    z_var = float(cat(episodes, "mu").var(0).sum())
    return probe, z_var


def open_loop_section(
    args: argparse.Namespace, model: Any, episodes: list[dict], probe: Callable, z_var: float, report: dict
) -> None:
    """2. open-loop prediction error per horizon, per policy, M's memory (warm or zero) and temperature."""
    import torch

    K = args.horizon
    gen = torch.Generator().manual_seed(args.seed)

    def open_loop(e: dict, start: int, warm: bool, tau: float) -> np.ndarray:
        s = {k: v[start : start + 1].clone() for k, v in e["post"].items()}
        if not warm:
            s["h"].zero_()
            s["c"].zero_()
        out = []
        for k in range(min(K, len(e["action"]) - 1 - start)):
            _, s, _ = model.step(
                s, torch.as_tensor(e["action"][start + k : start + k + 1]), generator=gen, temperature=tau
            )
            out.append(s["z"][0].numpy())
        return np.array(out)

    rows = []
    for policy in ("random", "balancer"):
        for warm in (True, False):
            for tau in (0.0, args.temperature):
                err_z = [[] for _ in range(K)]
                err_theta = [[] for _ in range(K)]
                err_x = [[] for _ in range(K)]
                copy_theta = [[] for _ in range(K)]
                for e in (e for e in episodes if e["policy"] == policy):
                    step = 5 if policy == "random" else 50  # random episodes are short (~22 rows)
                    starts = list(range(0, max(1, len(e["action"]) - 2), step))
                    for start in starts:
                        pred = open_loop(e, start, warm, tau)
                        real = e["mu"][start + 1 : start + 1 + len(pred)]
                        truth = e["probed"][start + 1 : start + 1 + len(pred)]  # the probe of the real frames
                        probed = probe(pred) if len(pred) else pred
                        for k in range(len(pred)):
                            err_z[k].append(((pred[k] - real[k]) ** 2).sum() / z_var)
                            err_theta[k].append(abs(probed[k, 1] - truth[k, 1]))
                            err_x[k].append(abs(probed[k, 0] - truth[k, 0]))
                            copy_theta[k].append(abs(e["probed"][start, 1] - truth[k, 1]))
                for k in sorted({0, 4, 9, 19, K - 1}):
                    if k < K and err_z[k]:
                        rows.append(
                            {
                                "policy": policy,
                                "memory": "warm" if warm else "zero",
                                "temperature": tau,
                                "k": k + 1,
                                "n": len(err_z[k]),
                                "z_err": float(np.mean(err_z[k])),
                                "theta_err_deg": float(np.degrees(np.mean(err_theta[k]))),
                                "x_err": float(np.mean(err_x[k])),
                                "theta_err_if_frozen_deg": float(np.degrees(np.mean(copy_theta[k]))),
                            }
                        )
    report["open_loop"] = rows
    print("\n2. open loop under the recorded actions (z error / var(z); |theta| error in degrees; |x| error)")
    print("| policy | M's memory | tau | k | n | z err | theta err | x err | theta err if frame frozen |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(
            f"| {r['policy']} | {r['memory']} | {r['temperature']} | {r['k']} | {r['n']} | {r['z_err']:.2f} | "
            f"{r['theta_err_deg']:.2f} | {r['x_err']:.3f} | {r['theta_err_if_frozen_deg']:.2f} |"
        )


def action_response(model: Any, episodes: list[dict], probe: Callable, report: dict) -> None:
    """3. action response: always-left vs always-right for k steps, dream (mode) vs physics."""
    import warnings

    import gymnasium as gym
    import torch

    warnings.filterwarnings("ignore", message=".*already returned terminated.*")  # physics past the limits
    physics = gym.make("CartPole-v1").unwrapped
    physics.reset(seed=0)
    responses = {k: ([], []) for k in (1, 3, 5, 10)}
    for e in episodes:
        states = e["post"]
        for t in range(0, len(e["action"]) - 1, 7):
            thetas_dream, thetas_real = {}, {}
            for a in (0, 1):
                s = {k: v[t : t + 1].clone() for k, v in states.items()}
                physics.state = e["state"][t].astype(np.float64)
                for k in range(1, 11):
                    _, s, _ = model.step(s, torch.tensor([a]), temperature=0.0)
                    real_state, *_ = physics.step(a)
                    if k in responses:
                        thetas_dream[(a, k)] = probe(s["z"][0].numpy())[1]
                        thetas_real[(a, k)] = real_state[2]
            for k in responses:
                responses[k][0].append(thetas_dream[(1, k)] - thetas_dream[(0, k)])
                responses[k][1].append(thetas_real[(1, k)] - thetas_real[(0, k)])
    report["action_response"] = []
    print("\n3. theta(always right) - theta(always left) after k steps, degrees (mean over real start states)")
    print("| k | dream (M, tau 0) | real physics | correlation |")
    print("| ---: | ---: | ---: | ---: |")
    for k, (dream, real) in responses.items():
        corr = float(np.corrcoef(dream, real)[0, 1]) if np.std(dream) > 0 else float("nan")
        report["action_response"].append(
            {
                "k": k,
                "dream_deg": float(np.degrees(np.mean(dream))),
                "real_deg": float(np.degrees(np.mean(real))),
                "corr": corr,
            }
        )
        print(f"| {k} | {np.degrees(np.mean(dream)):.2f} | {np.degrees(np.mean(real)):.2f} | {corr:.2f} |")


def done_head(mem: Any, episodes: list[dict], report: dict) -> None:
    """4. done head on real rows: p(done at t+1) from M after reading rows <= t; calibration, recall
    and false alarms by M's memory's age."""
    import torch

    probs, targets, ages = [], [], []
    for e in episodes:
        states = e["post"]
        a = mem.action_input(torch.as_tensor(e["action"]))
        with torch.no_grad():
            out, _ = mem.step(states["z"], a, (states["h"], states["c"]))
            z_next = torch.cat([states["z"][1:], states["z"][-1:]])  # the last row's is dropped below
            p = torch.sigmoid(mem.next_done_logit(mem.heads(out), z_next)).numpy()
        probs.append(p[:-1])
        targets.append(e["is_terminal"][1:].astype(float))
        ages.append(np.arange(len(p) - 1))
    probs, targets, ages = np.concatenate(probs), np.concatenate(targets), np.concatenate(ages)
    bins = [0, 0.05, 0.2, 0.5, 0.8, 1.0001]
    report["done_calibration"] = []
    print("\n4. done head on real rows (balancer + random): predicted vs actual termination")
    print("| p bin | rows | mean p | terminal frequency |")
    print("| --- | ---: | ---: | ---: |")
    for lo, hi in zip(bins[:-1], bins[1:]):
        m = (probs >= lo) & (probs < hi)
        if m.any():
            report["done_calibration"].append(
                {"bin": [lo, hi], "rows": int(m.sum()), "p": float(probs[m].mean()), "freq": float(targets[m].mean())}
            )
            print(f"| [{lo}, {min(hi, 1):.2f}) | {m.sum()} | {probs[m].mean():.3f} | {targets[m].mean():.3f} |")
    hit = probs[targets == 1] > 0.5
    false_alarm = (probs[targets == 0] > 0.5).mean()
    report["done_recall"], report["done_false_alarm"] = float(hit.mean()), float(false_alarm)
    print(f"recall of real terminations at p > 0.5: {hit.mean():.2f}; false alarms {false_alarm:.4f} per row")
    report["done_false_alarm_by_age"] = []
    print("| rows since the episode start (M's memory) | rows | false alarms (p > 0.5, not terminal) |")
    print("| --- | ---: | ---: |")
    for lo, hi in ((0, 32), (32, 64), (64, 128), (128, 256), (256, 500)):
        m = (ages >= lo) & (ages < hi) & (targets == 0)
        if m.any():
            rate = float((probs[m] > 0.5).mean())
            report["done_false_alarm_by_age"].append({"rows": [lo, hi], "n": int(m.sum()), "false_alarm": rate})
            print(f"| {lo}-{hi} | {m.sum()} | {rate:.3f} |")


def real_ends(controller: Any, episodes: int, crop: tuple[int, ...]) -> dict:
    """Play ``episodes`` real episodes with the true state kept: how each one ended."""
    import torch

    from lightning_wm.envs import EnvConfig, make_env

    real_env = make_env(EnvConfig(id="CartPole-v1", pixels=True, size=(64, 64), crop=crop, keep_state=True))
    ends = {"angle": 0, "edge": 0, "limit": 0}
    lengths, max_x, theta_end = [], [], []
    for i in range(episodes):
        obs, _ = real_env.reset(seed=900_000 + i)
        state, xs, t, done = controller.initial_state(1), [], 0, False
        while not done:
            with torch.no_grad():
                action, state = controller.policy_step(
                    torch.as_tensor(obs["image"])[None], state, controller.params.detach()
                )
            obs, _, term, trunc, _ = real_env.step(int(action[0]))
            x, _, theta, _ = obs["state"]
            xs.append(abs(x))
            t += 1
            done = term or trunc
        ends["edge" if abs(x) > X_LIMIT else "angle" if term else "limit"] += 1
        lengths.append(t)
        max_x.append(max(xs))
        theta_end.append(abs(theta))
    real_env.close()
    return {
        **ends,
        "mean_length": float(np.mean(lengths)),
        "max_abs_x": float(np.max(max_x)),
        "mean_abs_theta_end": float(np.mean(theta_end)),
    }


def dream_steps_past_limits(controller: Any, probe: Callable, dreams: int) -> float:
    """Along ``dreams`` dreams of the controller: the share of steps with the probed angle or position
    past the real limits while the dream runs on."""
    import torch

    dream = controller._dream_env(dreams)
    feats = dream.reset_tensor(2)
    past, steps = 0, 0
    active = torch.ones(dreams, dtype=torch.bool)
    for _ in range(500):
        feats, _, term, trunc = dream.step_tensor(controller._act(controller.params.detach(), feats))
        x, theta = probe(dream.state["z"].numpy()).T
        out = (np.abs(theta) > THETA_LIMIT) | (np.abs(x) > X_LIMIT)
        live = active.numpy() & ~(term | trunc).numpy()
        past += int((out & live).sum())
        steps += int(live.sum())
        active &= ~(term | trunc)
        if not active.any():
            break
    return past / max(steps, 1)


def score_controllers(
    args: argparse.Namespace, crop: tuple[int, ...], probe: Callable, ensemble: Any, members: list, report: dict
) -> Any:
    """5. controllers: real return, dream return (first / all starts), what the dream lets pass;
    returns the last controller built (None without ``--controller``)."""
    import torch

    from lightning_wm.agents.worldmodels.controller import Controller
    from lightning_wm.data.generations import GenerationDataModule
    from lightning_wm.envs import EnvConfig

    controller = None
    report["controllers"] = []
    env = EnvConfig(id="CartPole-v1", pixels=True, size=(64, 64), crop=crop, seed=100)
    spec = GenerationDataModule(env).spec
    for path in args.controller:
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
        known = inspect.signature(Controller).parameters
        hp = {k: v for k, v in ckpt["hyper_parameters"].items() if k in known}
        hp.update(vision_ckpt=args.vision, memory_ckpt=args.memory, train_in="dream")
        hp["es"] = {**hp.get("es", {}), "env_workers": 0}
        in_dream = {**hp.get("dream", {}), "dir": args.latents, "temperature": args.temperature}
        in_dream["ensemble"] = list(args.ensemble)
        entry = {"checkpoint": path}
        for starts in ("first", "all"):
            controller = Controller(spec, **{**hp, "dream": {**in_dream, "starts": starts}})
            controller.params.data.copy_(ckpt["state_dict"]["params"])
            returns = controller.evaluate_population(
                controller.params.detach()[None], args.dreams, seed=1, where="dream", per_episode=True
            )[0]
            entry[f"dream_{starts}"] = float(returns.mean())
            if starts == "first":
                entry["real"] = float(
                    controller.evaluate_population(
                        controller.params.detach()[None], args.real_episodes, seed=900_000, where="real", config=env
                    ).mean()
                )
                entry["dream_steps_past_limits"] = dream_steps_past_limits(controller, probe, args.dreams)
                entry["real_ends"] = real_ends(controller, args.real_episodes, crop)
                if args.ensemble:
                    entry["dream_disagreement"] = dream_disagreement(
                        args, ensemble, members, controller, lambda f: controller._act(controller.params.detach(), f)
                    )
        report["controllers"].append(entry)
    return controller


def print_controllers(report: dict) -> None:
    """5. the controllers' tables: returns and dream steps past the limits, and how the real episodes end."""
    if report["controllers"]:
        print("\n5. controllers: real return vs dream return; share of dream steps beyond the real limits")
        print("| checkpoint | real | dream (first-frame starts) | dream (all-row starts) | dream steps past limits |")
        print("| --- | ---: | ---: | ---: | ---: |")
        for c in report["controllers"]:
            print(
                f"| {c['checkpoint']} | {c['real']:.1f} | {c['dream_first']:.1f} | {c['dream_all']:.1f} | "
                f"{c['dream_steps_past_limits']:.3f} |"
            )
        print("\nhow the real episodes end (true state at the last step)")
        print(
            "| checkpoint | by angle | by track edge | 500 steps | mean length | max abs(x) | mean abs(theta) at the end |"
        )
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
        for c in report["controllers"]:
            e = c["real_ends"]
            print(
                f"| {c['checkpoint']} | {e['angle']} | {e['edge']} | {e['limit']} | {e['mean_length']:.1f} | "
                f"{e['max_abs_x']:.2f} | {e['mean_abs_theta_end']:.3f} |"
            )


def main() -> None:
    args = parse_args()
    import torch

    from lightning_wm.agents.worldmodels.vm_model import VisionMemoryModel

    torch.set_num_threads(1)
    os.environ.setdefault("SDL_VIDEODRIVER", "dummy")
    os.chdir(Path(args.workdir).resolve())
    report: dict = {
        "vision": args.vision,
        "memory": args.memory,
        "temperature": args.temperature,
        "ensemble": args.ensemble,
    }
    model = VisionMemoryModel.from_checkpoints(args.vision, args.memory, temperature=args.temperature)
    t0 = time.time()
    crop = tuple(args.crop)
    episodes = truth_episodes(args, crop)
    encode_episodes(model, episodes, t0)
    probe, z_var = fit_state_probe(args, episodes, report)
    open_loop_section(args, model, episodes, probe, z_var, report)
    action_response(model, episodes, probe, report)
    done_head(model.memory, episodes, report)
    ensemble, members = build_ensemble(args, model)
    controller = score_controllers(args, crop, probe, ensemble, members, report)
    print_controllers(report)
    # 6. ensemble disagreement: real episodes (teacher-forced), controllers' dreams, random-action dreams
    if args.ensemble:
        ensemble_section(args, episodes, ensemble, members, controller, report)
    Path("diagnostics.json").write_text(json.dumps(report, indent=1))
    print(f"\nwrote {Path('diagnostics.json').resolve()} ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
