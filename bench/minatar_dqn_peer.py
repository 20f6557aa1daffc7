"""A measured peer: the MinAtar repository's own ``examples/dqn.py`` (kenjyoung/MinAtar, PyTorch),
run unedited in its own venv for one game and seed up to a frame cap, on this machine.

Their file is not in this repository: fetch it (``git show HEAD:examples/dqn.py`` from a clone of
kenjyoung/MinAtar) into a folder outside the repo and pass its path. The venv needs only
``torch`` and ``minatar`` (pinned to our env build's version). Their script has no seed or frame
flag, so the child (:data:`CHILD`, run by the venv's python) imports their module, sets its
``NUM_FRAMES`` constant, seeds ``random``/``numpy``/``torch`` and the env, and replaces the
``Environment`` name their module looks up by a subclass that prints one ``peer_episode`` line per
finished episode (the return their loop sums, the frame count at its end). Their learning code
runs as written. The parent keeps the raw output, ends the child on a wall cap or SIGTERM, and
appends one record to a jsonl file: the mean of the last 100 training-episode returns at 250k,
500k, 750k and 1M frames (Young & Tian 2019's metric), frames reached, wall time, frames/s, the
load average and the env's settings.

    OMP_NUM_THREADS=1 nice -n 15 python bench/minatar_dqn_peer.py --dqn /work/peer/minatar/dqn.py \\
        --game breakout --seed 0 --frames 1000000 --wall 5400 --out bench/minatar_dqn_peer.jsonl

``--summarize LOG`` re-derives the record from a raw log this runner wrote (no child).
Imports only the standard library."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

VENV_PYTHON = "/work/venvs/minatar_dqn/bin/python"
CHECKPOINTS = (250_000, 500_000, 750_000, 1_000_000)
WINDOW = 100  # training episodes in the paper's running mean
CURVE_EVERY = 50_000  # frames between the points of the record's learning curve
EPISODE_TAG = "peer_episode"
CONFIG_TAG = "peer_config"
PROGRESS_TAG = "peer_progress"

# Run by the venv's python as ``-c CHILD dqn_path game seed frames out_prefix``. Ours, not theirs.
CHILD = r"""
import importlib.util, json, random, sys, time
import numpy, torch, minatar
from importlib.metadata import version

dqn_path, game, seed, frames, out_prefix = sys.argv[1:6]
seed, frames = int(seed), int(frames)
spec = importlib.util.spec_from_file_location("minatar_dqn_example", dqn_path)
peer = importlib.util.module_from_spec(spec)
spec.loader.exec_module(peer)
peer.NUM_FRAMES = frames
random.seed(seed); numpy.random.seed(seed); torch.manual_seed(seed)


made = []


class ObservedEnvironment(peer.Environment):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        made.append(self)
        self.seed(seed)
        self.frames, self.episode_return, self.start = 0, 0.0, time.time()
        print("%s %s" % ("__CONFIG__", json.dumps({
            "game": self.env_name, "seed": seed, "num_frames": frames,
            "sticky_action_prob": self.sticky_action_prob, "minatar": version("minatar"),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "device": str(peer.device)})), flush=True)

    def act(self, a):
        reward, terminated = super().act(a)
        self.frames += 1
        self.episode_return += float(reward)
        if terminated:
            print("%s %d %r" % ("__EPISODE__", self.frames, self.episode_return), flush=True)
            self.episode_return = 0.0
        if self.frames % 10000 == 0:
            print("%s %d %.1f" % ("__PROGRESS__", self.frames, time.time() - self.start), flush=True)
        return reward, terminated


peer.Environment = ObservedEnvironment
sys.argv = [dqn_path, "--game", game, "--output", out_prefix, "--verbose"]
peer.main()
for env in made:  # the last mark: frames at the cap (a cut episode prints no peer_episode line)
    print("%s %d %.1f" % ("__PROGRESS__", env.frames, time.time() - env.start), flush=True)
"""
CHILD = (
    CHILD.replace("__CONFIG__", CONFIG_TAG).replace("__EPISODE__", EPISODE_TAG).replace("__PROGRESS__", PROGRESS_TAG)
)


def parse_output(lines: list[str]) -> tuple[dict[str, Any], list[tuple[int, float]], list[tuple[int, float]]]:
    """The child's config, its finished episodes as ``(frame at the end, return)`` and its
    progress marks as ``(frames, seconds)``, in order; other lines (their logging) are skipped."""
    config: dict[str, Any] = {}
    episodes: list[tuple[int, float]] = []
    progress: list[tuple[int, float]] = []
    for line in lines:
        parts = line.split()
        if not parts:
            continue
        if parts[0] == CONFIG_TAG:
            config = json.loads(line[len(CONFIG_TAG) :])
        elif parts[0] == EPISODE_TAG and len(parts) == 3:
            episodes.append((int(parts[1]), float(parts[2])))
        elif parts[0] == PROGRESS_TAG and len(parts) == 3:
            progress.append((int(parts[1]), float(parts[2])))
    return config, episodes, progress


def mean_last_returns(episodes: list[tuple[int, float]], frame: int, window: int = WINDOW) -> float | None:
    """Mean return of the last ``window`` episodes that ended at or before ``frame`` (fewer if
    fewer ended); None when none did."""
    done = [ret for end, ret in episodes if end <= frame]
    if not done:
        return None
    last = done[-window:]
    return sum(last) / len(last)


def summarize(lines: list[str], game: str, seed: int, frames_cap: int) -> dict[str, Any]:
    """One jsonl record from the child's raw output: the running mean of the last
    :data:`WINDOW` training returns at each of :data:`CHECKPOINTS` the run reached (None for
    one it did not) and every :data:`CURVE_EVERY` frames reached, frames reached and frames/s
    from the last progress mark."""
    config, episodes, progress = parse_output(lines)
    reached = max([f for f, _ in progress] + [e for e, _ in episodes] + [0])
    seconds = progress[-1][1] if progress else None
    at = {str(c): (mean_last_returns(episodes, c) if c <= reached else None) for c in CHECKPOINTS}
    marks = range(CURVE_EVERY, reached + 1, CURVE_EVERY)
    curve = {str(m): mean_last_returns(episodes, m) for m in marks}
    return {
        "system": "minatar_examples_dqn",
        "game": game,
        "seed": seed,
        "frames_cap": frames_cap,
        "frames_reached": reached,
        "episodes": len(episodes),
        f"mean_last{WINDOW}_return_at": at,
        "final_mean_last100_return": mean_last_returns(episodes, reached),
        f"mean_last{WINDOW}_return_every_{CURVE_EVERY // 1000}k": curve,
        "train_seconds_at_last_mark": seconds,
        "frames_per_second": (progress[-1][0] / seconds) if progress and seconds else None,
        "sticky_action_prob": config.get("sticky_action_prob"),
        "minatar": config.get("minatar"),
        "torch": config.get("torch"),
        "torch_threads": config.get("torch_threads"),
        "device": config.get("device"),
    }


def run_child(args: argparse.Namespace, log_path: str) -> tuple[list[str], str, float]:
    """Run the peer until it ends, the wall cap passes or SIGTERM comes; the child (its own
    process group) is ended on the way out. Returns its lines, how it ended and the wall time."""
    prefix = os.path.splitext(log_path)[0]
    cmd = [args.python, "-u", "-c", CHILD, args.dqn, args.game, str(args.seed), str(args.frames), prefix]
    start = time.time()
    lines: list[str] = []
    ended = "finished"
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)

    def on_alarm(signum: int, frame: Any) -> None:
        raise TimeoutError

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGALRM, on_alarm)
    signal.signal(signal.SIGTERM, on_term)
    signal.alarm(max(1, int(args.wall)))
    try:
        with open(log_path, "w") as log:
            assert child.stdout is not None
            for line in child.stdout:
                log.write(line)
                log.flush()
                lines.append(line)
        if child.wait() != 0:
            ended = f"exit {child.returncode}"
    except TimeoutError:
        ended = "wall cap"
    except KeyboardInterrupt:
        ended = "signal"
    finally:
        signal.alarm(0)
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGTERM)
            try:
                child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()
    return lines, ended, time.time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dqn", default="/work/peer/minatar/dqn.py", help="their examples/dqn.py")
    parser.add_argument("--python", default=VENV_PYTHON, help="the peer venv's python")
    parser.add_argument("--game", default="breakout")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--frames", type=int, default=1_000_000)
    parser.add_argument("--wall", type=float, default=3600.0, help="wall-clock cap, seconds")
    parser.add_argument("--logdir", default="/work/peer/minatar/runs", help="raw logs (outside the repo)")
    parser.add_argument("--out", default=None, help="jsonl to append the record to")
    parser.add_argument("--summarize", default=None, help="a raw log to re-derive the record from")
    args = parser.parse_args()
    if args.summarize:
        with open(args.summarize) as f:
            record = summarize(f.readlines(), args.game, args.seed, args.frames)
        record.update(ended="from log", log=args.summarize)
    else:
        if not os.path.isfile(args.dqn):
            sys.exit(f"minatar_dqn_peer: {args.dqn} not found (fetch kenjyoung/MinAtar's examples/dqn.py)")
        os.makedirs(args.logdir, exist_ok=True)
        log_path = os.path.join(args.logdir, f"{args.game}_seed{args.seed}.log")
        load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
        lines, ended, wall = run_child(args, log_path)
        record = summarize(lines, args.game, args.seed, args.frames)
        record.update(
            ended=ended,
            wall_seconds=round(wall, 1),
            load_before=load_before,
            load_after=" ".join(f"{x:.2f}" for x in os.getloadavg()),
            log=log_path,
        )
    line = json.dumps(record)
    print(line)
    if args.out:
        from lightning_wm.io import append_json_line

        append_json_line(args.out, record)


if __name__ == "__main__":
    main()
