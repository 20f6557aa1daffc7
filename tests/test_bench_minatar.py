"""bench/minatar.py's parts: when it evaluates, the paper's metric from the training episodes, the
trivial policies, the evaluation env's time limit, the summary and the plot it makes from records."""

import argparse
import json
import math
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from support.bench_scripts import load_bench_script

bench = load_bench_script("minatar.py")
report = bench.summary.__globals__  # bench/minatar_report.py's names, as the bench imported them
trivial = bench.trivial_scores.__globals__  # bench/minatar_trivial.py's


def _run(system, seed, points, game="breakout"):
    history = [{"frames": f, "seconds": s, "eval_return": r, "eval_std": 0.0} for f, s, r, *_ in points]
    for row, point in zip(history, points):
        row["train_return"] = point[3] if len(point) > 3 else None
    return {"system": system, "game": game, "seed": seed, "history": history, "frames": history[-1]["frames"],
            "frames_per_s": 1000.0}  # fmt: skip


def test_eval_schedule_evaluates_past_each_multiple_and_at_the_end():
    schedule = bench.EvalSchedule(every=100, frames=350, seconds=60.0)
    due = [f for f in (40, 99, 120, 130, 260, 290, 330) if schedule.due(f, 1.0)]
    assert due == [120, 260, 330]  # the first step past each multiple of 100 (past 200: 260)
    assert not schedule.over(340, 59.0) and schedule.due(352, 2.0) and schedule.over(352, 2.0)
    assert schedule.due(10, 61.0), "the time budget ends the run with an evaluation"
    with pytest.raises(ValueError, match="--eval-every"):
        bench.EvalSchedule(0, 10, 1.0)


def test_eval_schedule_wall_cap_counts_evaluations_too():
    schedule = bench.EvalSchedule(every=100, frames=1000, seconds=60.0, wall_seconds=90.0)
    assert not schedule.due(50, 10.0, 89.0)
    assert schedule.due(60, 10.0, 90.0) and schedule.over(60, 10.0, 90.0), "training 10 s, wall 90 s: over"


def test_training_returns_keep_the_last_window_of_episodes_whoever_pops_them():
    popped = [[{"return": 1.0, "length": 3}], [], [{"return": 2.0, "length": 3}, {"return": 6.0, "length": 3}]]
    datamodule = SimpleNamespace(pop_env_stats=lambda: SimpleNamespace(episodes=popped.pop(0)))
    training = bench.TrainingReturns(window=2)
    assert math.isnan(training.mean())
    training.tee(datamodule)
    stats = datamodule.pop_env_stats()
    assert stats.episodes == [{"return": 1.0, "length": 3}], "the caller still gets the episodes"
    assert training.mean() == 1.0
    datamodule.pop_env_stats(), datamodule.pop_env_stats()
    assert training.mean() == 4.0 and training.count == 3  # the last two: (2 + 6) / 2


def test_trivial_policies_act_constant_or_seeded_uniform():
    env = SimpleNamespace(unwrapped=SimpleNamespace(action_set=[0, 2, 4]), action_space=None)  # Freeway's
    policies = trivial["trivial_policies"](env, seed=3)
    assert list(policies) == ["random", "always no-op", "always up", "always down"]
    obs = torch.zeros(5, 10, 10, 7)
    action, state, extras = policies["always up"].act(obs, policies["always up"].initial_state(5), False)
    assert action.tolist() == [1] * 5 and state.shape == (5,) and extras == {}  # index into the action set
    random_a = policies["random"].act(obs, None, False)[0]
    random_b = trivial["trivial_policies"](env, seed=3)["random"].act(obs, None, False)[0]
    assert torch.equal(random_a, random_b) and random_a.dtype == torch.int64
    assert set(policies["random"](obs.numpy()).tolist()) <= {0, 1, 2}


def test_trivial_scores_are_the_mean_return_of_each_policy_and_cached_by_key():
    env = SimpleNamespace(unwrapped=SimpleNamespace(action_set=[0, 1, 3]), action_space=None, close=lambda: None)

    def play(policy):  # returns: the constant action index taken on two observations
        return [float(policy.act(torch.zeros(2), None, False)[0][0])] * 2 if policy.action is not None else [0.5]

    scores = trivial["trivial_scores"](play, lambda: env, seed=0)
    assert scores == {"random": 0.5, "always no-op": 0.0, "always left": 1.0, "always right": 2.0}
    key = trivial["trivial_key"]("ours", {"id": "MinAtar/Breakout-v1"}, 20, 10_000)
    args = argparse.Namespace(trivial_cache=json.dumps({key: {"random": 9.0}}), game="breakout", seed=0)
    assert trivial["cached_trivial"](args, key, lambda: pytest.fail("cached: not computed")) == {
        "key": key,
        "scores": {"random": 9.0},
    }
    assert trivial["cached_trivial"](args, key + " ", lambda: {"random": 1.0})["scores"] == {"random": 1.0}


def test_evaluation_env_is_the_runs_env_with_a_time_limit():
    from lightning_wm.envs import EnvConfig

    env = EnvConfig(id="MinAtar/Seaquest-v1", num_envs=16, kwargs={"sticky_action_prob": 0.0})
    datamodule = SimpleNamespace(env=env, eval=SimpleNamespace(env=None))
    config = bench.evaluation_env(datamodule)
    assert config.max_episode_steps == bench.EVAL_MAX_STEPS and config.kwargs == env.kwargs
    limited = EnvConfig(id="MinAtar/Seaquest-v1", max_episode_steps=500)
    assert bench.evaluation_env(SimpleNamespace(env=env, eval=SimpleNamespace(env=limited))).max_episode_steps == 500


def test_seaquest_evaluation_ends_at_the_time_limit():
    """The hang: a submarine that stays at the surface never ends an episode without the limit."""
    pytest.importorskip("minatar")
    from lightning_wm.data.collector import run_evaluation
    from lightning_wm.envs import EnvConfig

    config = bench.evaluation_env(
        SimpleNamespace(env=EnvConfig(id="MinAtar/Seaquest-v1", max_episode_steps=60), eval=None)
    )
    policy = trivial["TrivialPolicy"](6, action=0)  # no-op: stays at the surface
    episodes = run_evaluation(config, policy, 2, 2, 10_000)
    assert [e["length"] for e in episodes] == [60.0, 60.0] and [e["return"] for e in episodes] == [0.0, 0.0]


def test_summary_has_both_metrics_per_point_the_papers_best_and_frames_to_reach():
    runs = [
        _run("impala", 1, [(150, 12.0, 2.0, 1.5), (240, 22.0, 6.0, 4.0), (390, 40.0, 8.0, 5.0)]),  # late points
        _run("impala", 0, [(101, 10.0, 1.0, 0.5), (205, 20.0, 3.0, 2.0), (301, 30.0, 5.0, 3.0)]),
    ]
    assert report["value_at"](runs[0]["history"], 200, 100) == 6.0
    assert report["value_at"](runs[1]["history"], 400, 100) is None
    assert report["frames_to_reach"](runs[1]["history"], 3.0) == 205
    assert report["frames_to_reach"](runs[1]["history"], 9.0) is None
    table = bench.summary(runs, every=100, targets=[4.0])  # per-seed values in seed order
    assert "| impala | breakout | 2 | 100 | 1.00 (0.50, 1.50) | 1.50 (1.00, 2.00) | – | 11 s |" in table
    assert "| impala | breakout | 2 | 200 | 3.00 (2.00, 4.00) | 4.50 (3.00, 6.00) | – | 21 s |" in table
    assert "| impala | breakout | 4 | 301, 240 |" in table
    again = _run("impala", 0, [(101, 10.0, 1.0, 0.5)])  # a shorter run of seed 0: the longer one counts
    assert bench.summary([*runs, again], every=100, targets=[]) == bench.summary(runs, every=100, targets=[])
    five_m = [_run("impala", 0, [(1_000_000, 1.0, 2.0, None)])]
    five_m[0]["eval_every"] = 1_000_000
    table = bench.summary(five_m, every=1_000_000, targets=[])
    assert "| impala | breakout | 1 | 1,000,000 | – | 2.00 (2.00) | 9.5 (DQN) |" in table, "no training episode: –"
    assert report["paper_best"]("asterix", 5_000_000) == ("AC(λ=0)", 20.5)


def test_frames_to_the_same_return_interpolate_between_evaluations_against_the_config():
    curve = [(100, 10.0), (200, 20.0), (300, 40.0)]
    assert report["frames_at_level"](curve, 30.0) == 250.0 and report["frames_at_level"](curve, 20.0) == 200.0
    assert report["frames_at_level"](curve, 10.0) is None, "reached at the first point: no earlier point to place it"
    assert report["frames_at_level"](curve, 41.0) is None
    config = [
        _run("impala", s, [(100, 1.0, 0.0, 10.0 + s), (200, 2.0, 0.0, 20.0 + s), (300, 3.0, 0.0, 40.0 + s)])
        for s in (0, 2)
    ]
    actors = [_run("impala", 0, [(100, 1.0, 0.0, 5.0), (200, 2.0, 0.0, 15.0), (300, 3.0, 0.0, 35.0)])]
    actors[0]["sets"] = [["data.init_args.acting.num_actors", "1"]]
    table = bench.frames_ratio_table(config + actors, fractions=(0.5, 1.0))
    # config mean 11 / 21 / 41, variant 5 / 15 / 35: levels 17.5 and 35 of the lower final mean
    assert "| impala (data.acting.num_actors 1) | breakout | 2 / 1 | 0.5 × 35.00 = 17.50 | 165 | 212 | 1.29 |" in table
    assert "| 1 × 35.00 = 35.00 | 270 | 300 | 1.11 |" in table
    assert bench.frames_ratio_table(config, fractions=(0.5,)) == "", "no variant: no table"


def test_runs_with_other_settings_are_summarised_apart():
    shipped = _run("dyna", 0, [(101, 10.0, 1.0)])
    constant_lr = {
        **_run("dyna", 0, [(101, 10.0, 3.0)]),
        "sets": [["model.init_args.policy.init_args.optim.lr", "0.002"]],
    }
    table = bench.summary([shipped, constant_lr], every=100, targets=[])
    assert "| dyna | breakout | 1 | 100 | – | 1.00 (1.00) |" in table
    assert "| dyna (policy.optim.lr 0.002) | breakout | 1 | 100 | – | 3.00 (3.00) |" in table


def test_sets_that_repeat_the_configs_own_value_are_not_a_variant(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("model:\n  init_args:\n    loss:\n      value_weight: 2.0\n      lambda_: 0.8\n")
    sets = [["model.init_args.loss.value_weight", "2"], ["model.init_args.loss.lambda_", "1.0"],
            ["model.init_args.loss.entropy_weight_end", "0.002"], ["model.init_args.loss.value_weight.x", "1"]]  # fmt: skip
    changed, same = report["split_sets"](config, sets)
    assert same == [["model.init_args.loss.value_weight", "2"]]
    assert changed == sets[1:]


def test_trivial_table_means_over_seed_sets_and_the_plot_is_written(tmp_path):
    runs = [_run("impala", s, [(100, 1.0, 1.0, 0.5), (200, 2.0, 2.0, 1.0)], game="freeway") for s in (0, 1)]
    for seed, run in enumerate(runs):
        run["eval_every"] = 100
        run["trivial"] = {"key": f"k{seed}", "scores": {"random": 0.5 + seed, "always up": 14.0 + seed}}
    table = report["trivial_table"](runs)
    assert "| freeway | random 1.00, always up 14.50 | 2 |" in table
    assert table in bench.summary(runs, every=100, targets=[])
    path = tmp_path / "minatar_freeway_1k.png"
    assert report["plot_games"](runs, str(tmp_path), "_1k") == [str(path)]
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_training_window_of_fewer_than_100_episodes_is_marked():
    runs = [_run("muzero", s, [(100, 1.0, 14.3, 0.5), (200, 2.0, 14.3, 9.5)], game="freeway") for s in (0, 1)]
    for run, ended in zip(runs, ([16, 72], [60, 140])):
        for row, n in zip(run["history"], ended):
            row["train_episodes"] = n
    table = bench.summary(runs, every=100, targets=[])
    assert "| 0.50 (0.50†, 0.50†) |" in table and "| 9.50 (9.50†, 9.50) |" in table
    assert "† fewer than 100 training episodes had ended" in table
    # seed 0's last 56 episodes (16 -> 72): (9.5 * 72 - 0.5 * 16) / 56 = 12.07; seed 1 ends past 100
    assert "| muzero | freeway | 200, 200 | 12.07 (56), – |" in table
    assert report["since_previous"](runs[0]["history"], 0) == (16, 0.5), "the first interval starts at 0"
    assert report["since_previous"](runs[0]["history"], -1) == report["since_previous"](runs[0]["history"], 1)
    assert report["since_previous"]([], -1) is None
    assert "†" not in bench.summary([_run("impala", 0, [(100, 1.0, 1.0, 0.5)])], every=100, targets=[])


def test_a_stopped_runs_record_so_far_is_marked_until_its_finished_record_comes(tmp_path):
    so_far = {**_run("dreamer", 0, [(100, 1.0, 3.0, 2.5)]), "finished": False, "stopped_at_frames": 140}
    table = bench.summary([so_far], every=100, targets=[])
    assert (
        "| dreamer‡ | breakout | 1 | 100 |" in table and "‡ a seed's run was stopped before its frame budget" in table
    )
    done = {**_run("dreamer", 0, [(100, 1.0, 3.0, 2.5), (200, 2.0, 5.0, 4.5)]), "finished": True}
    table = bench.summary([so_far, done], every=100, targets=[])
    assert "| dreamer | breakout | 1 | 200 |" in table and "‡" not in table, "the finished record supersedes it"
    old = _run("dreamer", 0, [(100, 1.0, 3.0, 2.5)])  # records before `finished` existed: finished runs
    assert "‡" not in bench.summary([old], every=100, targets=[])
    (path,) = report["plot_games"]([so_far], str(tmp_path))
    assert path.endswith("minatar_breakout.png")


def test_the_legend_leaves_out_speed_only_overrides():
    name = "muzero (compile {mode: step}; search.compile true; search.temperature.boundaries [12500, 20000])"
    assert report["legend_name"](name) == "muzero (search.temperature.boundaries [12500, 20000])"
    assert report["legend_name"]("muzero (compile {mode: step}; optim.implementation fused)") == "muzero"
    assert report["legend_name"]("impala") == "impala"


def test_a_run_that_ends_before_the_papers_points_gets_their_first_as_a_level_line():
    class Axes:
        def __init__(self):
            self.points, self.levels = [], []

        def scatter(self, xs, ys, **kwargs):
            self.points.append((kwargs["label"], list(xs), list(ys)))

        def axhline(self, y, **kwargs):
            self.levels.append((kwargs["label"], y))

    short, long = Axes(), Axes()
    report["_paper_references"](short, "breakout", 200_000)
    report["_paper_references"](long, "breakout", 5_000_000)
    assert short.points == [] and short.levels == [
        ("paper DQN at 1M frames", 9.5),
        ("paper AC(λ=0.8) at 1M frames", 9.0),
    ]
    assert long.levels == [] and long.points[0] == ("paper DQN", [1_000_000, 5_000_000], [9.5, 10.0])


def test_learner_metrics_keep_the_scalar_train_values_only():
    class Trainer:
        callback_metrics = {
            "train/entropy_loss": torch.tensor(1.2345678),
            "train/cur_lr": torch.tensor(0.002),
            "val/return": torch.tensor(3.0),
            "train/per_env": torch.ones(4),
        }

    assert bench.learner_metrics(Trainer()) == {"entropy_loss": 1.23457, "cur_lr": 0.002}


def test_unshadow_moves_the_bench_folder_to_the_end_of_the_path(monkeypatch):
    here = str(bench.ROOT) + "/bench"
    monkeypatch.setattr(bench.sys, "path", [here, "/site", "/other"])
    bench.unshadow_minatar(f"{here}/minatar.py")
    assert bench.sys.path == ["/site", "/other", here]  # `minatar` is the package; a spawned re-run finds benchlib


@pytest.mark.slow
def test_a_run_with_actor_processes_records(tmp_path):
    import subprocess
    import sys

    out = tmp_path / "runs.jsonl"
    command = [sys.executable, f"{bench.ROOT}/bench/minatar.py", "--systems", "impala", "--games", "breakout",
               "--seeds", "0", "--frames", "2000", "--eval-every", "1000", "--eval-episodes", "1",
               "--wall-minutes", "3", "--set", "data.init_args.acting.num_actors", "1", "--out", str(out)]  # fmt: skip
    subprocess.run(command, check=True, timeout=300, cwd=tmp_path, capture_output=True)
    (record,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert record["frames"] >= 2000 and record["history"][-1]["train_return"] is not None
    assert record["cpu"] == bench.cpu_model() and record["cpu"] != "unknown"  # which machine it ran on
    assert record["sets"] == [["data.init_args.acting.num_actors", "1"]] and record["sets_same_as_config"] == []


def _evaluation(identity, schedule=None, training=None):
    from minatar_evaluation import BenchEvaluation

    schedule = schedule or bench.EvalSchedule(every=100, frames=1000, seconds=600.0)
    return BenchEvaluation(schedule, lambda module: [1.0], training or bench.TrainingReturns(window=3),
                           lambda *row: {}, lambda row: None, identity)  # fmt: skip


def test_the_evaluation_state_rides_in_a_checkpoint_and_resumes_the_record():
    identity = {"system": "muzero", "game": "breakout", "seed": 0, "sets": []}
    first = _evaluation(identity)
    first.history = [{"frames": 120}, {"frames": 230}]
    first.eval_time, first.seconds_before = 4.0, 50.0
    first.training.add([{"return": r} for r in (1.0, 2.0, 3.0, 4.0)])
    state = first.state_dict()
    assert state["seconds"] >= 50.0 and state["training"] == {"recent": [2.0, 3.0, 4.0], "count": 4}

    schedule = bench.EvalSchedule(every=100, frames=1000, seconds=600.0)
    resumed = _evaluation(identity, schedule)
    resumed.load_state_dict(state)
    assert resumed.history == first.history and resumed.eval_time == 4.0
    assert resumed.training.mean() == 3.0 and resumed.training.count == 4
    assert resumed.seconds() >= state["seconds"], "training time goes on from the saved clock"
    assert not schedule.due(260, 1.0) and schedule.due(301, 1.0), "the next point is past the last row's frames"


def test_a_stop_request_saves_the_runs_checkpoint_and_an_error_does_not():
    from pytorch_lightning.utilities.exceptions import SIGTERMException

    from lightning_wm.signals import RunAborted, RunStopped

    class Trainer:
        def __init__(self):
            self.saved, self.popped = [], 0
            self.datamodule = self

        def save_checkpoint(self, path):
            self.saved.append(path)

        def pop_env_stats(self):
            self.popped += 1

    identity = {"system": "muzero", "game": "breakout", "seed": 0, "sets": []}
    for stop in (RunStopped(15), SIGTERMException()):
        evaluation, trainer = _evaluation(identity), Trainer()
        evaluation.checkpoint = Path("run/bench.ckpt")
        evaluation.on_exception(trainer, None, stop)
        assert trainer.saved == [evaluation.checkpoint] and trainer.popped == 1 and evaluation.saved_on_stop
    for failure in (RunAborted(2), ValueError("nan")):
        evaluation, trainer = _evaluation(identity), Trainer()
        evaluation.checkpoint = Path("run/bench.ckpt")
        evaluation.on_exception(trainer, None, failure)
        assert trainer.saved == [] and not evaluation.saved_on_stop, "the last evaluation's checkpoint stays"
    unsaved, trainer = _evaluation(identity), Trainer()
    unsaved.on_exception(trainer, None, RunStopped(15))
    assert trainer.saved == [] and not unsaved.saved_on_stop, "no --run-dir: nothing to save"


def test_the_frames_of_the_saved_step_ride_in_the_state_and_older_states_fall_back_to_the_last_row():
    identity = {"system": "muzero", "game": "breakout", "seed": 0, "sets": []}
    first = _evaluation(identity)
    first.history, first.frames = [{"frames": 120}], 164
    state = first.state_dict()
    resumed = _evaluation(identity)
    resumed.load_state_dict(state)
    assert resumed.frames == 164
    older = _evaluation(identity)
    older.load_state_dict({k: v for k, v in state.items() if k != "frames"})
    assert older.frames == 120


def test_a_checkpoint_of_another_run_is_refused_by_name():
    state = _evaluation({"system": "muzero", "game": "breakout", "seed": 0, "sets": []}).state_dict()
    other = _evaluation({"system": "muzero", "game": "breakout", "seed": 1, "sets": []})
    with pytest.raises(SystemExit, match="'seed': 0.*give another --run-dir"):
        other.load_state_dict(state)


def test_a_run_resumed_past_its_time_caps_is_refused_not_recorded_as_finished():
    identity = {"system": "dreamer", "game": "asterix", "seed": 0, "sets": []}
    first = _evaluation(identity)
    first.history, first.frames, first.seconds_before = [{"frames": 75}], 96, 6120.0
    state = first.state_dict()
    short = _evaluation(identity, bench.EvalSchedule(every=25, frames=200, seconds=15 * 60.0))
    with pytest.raises(SystemExit, match=r"96 of 200 frames after 102\.0 min of training.*--minutes 15 .*larger caps"):
        short.load_state_dict(state)
    longer = _evaluation(identity, bench.EvalSchedule(every=25, frames=200, seconds=1000 * 60.0))
    longer.load_state_dict(state)
    assert longer.frames == 96 and longer.history == [{"frames": 75}]


@pytest.mark.slow
def test_a_cut_run_resumes_from_its_run_folder_and_a_finished_one_is_not_run_again(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    out, run_dir = tmp_path / "runs.jsonl", tmp_path / "runs"
    command = [sys.executable, f"{bench.ROOT}/bench/minatar.py", "--systems", "muzero", "--games", "breakout",
               "--seeds", "0", "--frames", "2000", "--eval-every", "1000", "--eval-episodes", "1",
               "--wall-minutes", "4", "--set", "model.init_args.search.num_simulations", "4",
               "--set", "data.init_args.batch_size", "16", "--run-dir", str(run_dir), "--out", str(out)]  # fmt: skip
    checkpoint = run_dir / "muzero-breakout-seed0" / "bench.ckpt"
    log = tmp_path / "first.err"
    with open(log, "w") as err:
        first = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=err)
    try:
        deadline = time.monotonic() + 240
        while not checkpoint.exists() and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)  # the first evaluation's checkpoint: then cut the run
        assert checkpoint.exists(), "no checkpoint after the first evaluation"
        os.kill(first.pid, signal.SIGTERM)
        first.wait(timeout=60)
    finally:
        if first.poll() is None:
            first.kill()
    stopped = re.search(r"\[stopped\] muzero breakout seed 0 by SIGTERM at (\d+) frames: .*bench.ckpt holds the run",
                        log.read_text())  # fmt: skip
    assert stopped and int(stopped.group(1)) >= 1008, "the stop saved the run at the step it reached"
    (so_far,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert so_far["finished"] is False and so_far["stopped_at_frames"] == int(stopped.group(1))
    assert [row["frames"] for row in so_far["history"]] == [1008], "a stopped run's record so far, marked"

    resumed = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300, check=True)
    assert f"[resume] muzero breakout seed 0: {stopped.group(1)} frames" in resumed.stderr
    assert "(the last at 1008 frames)" in resumed.stderr
    _, record = [json.loads(line) for line in out.read_text().splitlines()]
    assert record["finished"] is True and "‡" not in bench.summary([so_far, record], 1000, []), "it supersedes"
    frames = [row["frames"] for row in record["history"]]
    assert frames[0] == 1008 and frames[-1] >= 2000 and len(frames) == 2, "the cut run's row, then the resumed run's"
    seconds = [row["seconds"] for row in record["history"]]
    assert seconds == sorted(seconds), "the clocks go on over the cut"

    again = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=120, check=True)
    assert "finished earlier" in again.stdout and len(out.read_text().splitlines()) == 2
