"""DataModules fed by actors, end to end under Lightning: the replay ratio holds, weights and
episode statistics flow, unrolls overlap by one, the Dreamer actors config runs from the CLI,
and Ctrl-C on a CLI fit leaves no actor behind."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import pytorch_lightning as pl
import torch

from lightning_wm.callbacks import default_callbacks
from lightning_wm.cli import main
from lightning_wm.data.modules import ReplayDataModule, UnrollDataModule
from lightning_wm.data.samplers import SequenceSampler
from lightning_wm.data.settings import ActingSettings, ReplaySettings
from lightning_wm.envs import EnvConfig

from support.presets import REPLAY_DATA_TINY, TINY_AGENT, data_overrides
from support.processes import cmdline, descendants, wait_gone, wait_until
from support.tiny_agent import TinyAgent

ROOT = Path(__file__).resolve().parents[1]


class Recorder(pl.Callback):
    """Keeps every training batch and the metrics logged on it."""

    def __init__(self) -> None:
        self.batches, self.logged = [], []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batches.append({k: v.clone() for k, v in batch.items() if isinstance(v, torch.Tensor)})

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.logged.append({k: float(v) for k, v in trainer.logged_metrics.items()})


def _fit(datamodule, steps: int) -> Recorder:
    recorder = Recorder()
    trainer = pl.Trainer(
        max_steps=steps,
        logger=True,
        enable_checkpointing=False,
        enable_progress_bar=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        log_every_n_steps=5,
        callbacks=[*default_callbacks(), recorder],
        default_root_dir=".",
    )
    trainer.fit(TinyAgent(datamodule.spec), datamodule)
    return recorder


@pytest.mark.slow
def test_replay_with_actors_keeps_the_ratio_and_reports():
    dm = ReplayDataModule(
        EnvConfig("CartPole-v1"),
        batch_size=4,
        sampler=SequenceSampler(8),
        prefill=64,
        replay_ratio=0.2,
        replay=ReplaySettings(capacity=4000),
        acting=ActingSettings(num_actors=2, envs_per_actor=2, chunk_length=8, timeout_s=120),
    )
    recorder = _fit(dm, 40)
    buffer = dm.buffer
    per_stream = buffer.rows_per_stream
    assert buffer.num_streams == 4 and per_stream.sum() > 0
    assert per_stream[0] == per_stream[1] and per_stream[2] == per_stream[3], "an actor's envs fill its two streams"
    slack, chunk = 2 * 16, 16
    rows = int(per_stream.sum())
    owed = 64 + 41 / 0.2  # Lightning fetched one batch ahead of the 40 it trained on
    assert abs(rows - owed) <= slack + chunk, f"{rows} rows for {owed} owed by the replay ratio"
    written = np.arange(buffer.column("policy_version").shape[1])[None, :] < per_stream[:, None]
    versions = buffer.column("policy_version")[written]
    assert versions.min() == -1, "the prefill came from the random policy"
    # up to ~7 chunks (112 rows) made with the first weights can wait in the queue and in the
    # blocked actors; at least 269 - 48 - 64 = 157 rows past the prefill make some of them newer
    assert versions.max() >= 1, "published weights reached the actors"
    last = recorder.logged[-1]
    assert last["env/steps"] == rows
    assert "env/episode_return" in last, "episodes from the actors reach env/*"
    assert 0 <= last["actors/policy_lag"] <= 40 and last["actors/frames_per_s"] > 0
    assert "actors/queue_depth" in last and "actors/wait_fraction" in last
    assert dm.acting.pool is None, "teardown stopped the actors"


@pytest.mark.slow
def test_unrolls_in_process_overlap_by_one():
    dm = UnrollDataModule(EnvConfig("CartPole-v1", num_envs=2), unroll_length=5, batch_size=2)
    batches = _fit(dm, 6).batches
    assert batches[0]["obs"].shape == (2, 6, 4) and batches[0]["action"].dtype == torch.int64
    for now, nxt in zip(batches, batches[1:]):
        for key in ("obs", "reward", "is_first", "is_last", "action", "policy_version"):
            torch.testing.assert_close(now[key][:, -1], nxt[key][:, 0])
    # acted with the live module; Lightning fetches batch k+1 before step k trains, so its rows
    # (but its first, shared with batch k) were made by the weights of step k - 1
    assert [int(b["policy_version"][0, -1]) for b in batches] == [0] + list(range(len(batches) - 1))


@pytest.mark.slow
def test_unrolls_from_actors():
    dm = UnrollDataModule(
        EnvConfig("CartPole-v1"),
        unroll_length=4,
        batch_size=4,
        acting=ActingSettings(num_actors=2, envs_per_actor=2, timeout_s=120),
    )
    recorder = _fit(dm, 12)
    for batch in recorder.batches:
        assert batch["obs"].shape == (4, 5, 4) and batch["policy_version"].shape == (4, 5)
        assert (batch["policy_version"] >= 0).all() and (batch["policy_version"] <= 12).all()
    assert recorder.logged[-1]["env/steps"] > 0 and "actors/policy_lag" in recorder.logged[-1]


@pytest.mark.slow
def test_dreamer_actors_config_from_the_cli():
    cli = main(
        args=[
            "fit",
            "--config",
            str(ROOT / "configs/dreamer/cartpole_actors.yaml"),
            "--config",
            str(ROOT / "configs/dreamer/presets/debug.yaml"),  # the shipped smoke-test sizes, tested here too
            "--trainer.max_steps",
            "8",
            "--trainer.log_every_n_steps",
            "2",
            "--trainer.val_check_interval",
            "8",
            "--trainer.enable_progress_bar",
            "false",
            "--trainer.run_name",
            "run",
            *data_overrides(REPLAY_DATA_TINY),
        ]
    )
    assert cli.trainer.global_step == 8
    metrics = cli.trainer.logged_metrics
    assert "actors/policy_lag" in metrics and "val/return" in metrics and metrics["env/steps"] >= 64


# A shell starts `cmd &` jobs with SIGINT ignored and Python keeps that disposition, so a suite run
# in the background would hand the fit an ignored Ctrl-C; the script installs Python's own handler,
# as a terminal-started fit has it.
CTRL_C_FIT = """
import signal
import sys
sys.path.insert(0, {tests!r})
from lightning_wm.cli import main

if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)
    main()
"""


@pytest.mark.slow
def test_ctrl_c_on_a_fit_with_actors_leaves_no_orphans(tmp_path):
    script = tmp_path / "fit.py"
    script.write_text(CTRL_C_FIT.format(tests=str(ROOT / "tests")))
    training = tmp_path / "training"  # written by the fit once it has trained a step
    probe = {"class_path": "support.fit_probes.MarkAt", "init_args": {"path": str(training), "step": 1}}
    args = [
        sys.executable,
        str(script),
        "fit",
        *TINY_AGENT,
        "--trainer.callbacks",
        json.dumps([probe]),
        "--data.acting.num_actors",
        "2",
        "--data.acting.chunk_length",
        "8",
        "--trainer.max_steps",
        "100000",
        "--trainer.enable_progress_bar",
        "false",
        "--trainer.limit_val_batches",
        "0",
    ]
    # stderr to a file, not a pipe: the fit's progress lines would fill an unread pipe (64 KiB) and
    # block it in write(), and then it could not shut down after Ctrl-C either
    log = tmp_path / "stderr.txt"
    proc = subprocess.Popen(
        args,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.DEVNULL,
        stderr=log.open("w"),
        text=True,
        start_new_session=True,
        cwd=tmp_path,
    )

    def training_with_actors() -> bool:  # both actors spawned and a step trained
        assert proc.poll() is None, log.read_text()
        actors = [p for p in descendants(proc.pid) if "spawn" in cmdline(p)]
        return len(actors) >= 2 and training.exists()

    try:
        wait_until(training_with_actors, 240, interval=0.1, what="training with both actors")
        family = descendants(proc.pid)
        os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C goes to the whole process group
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired as err:
            raise AssertionError(
                f"the fit did not stop within 60 s of Ctrl-C; its stderr ends:\n{log.read_text()[-3000:]}"
            ) from err
        assert not wait_gone(family, seconds=10), "actors outlived the interrupted learner"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_agent_publisher_cadence():
    """Attaches when fit starts (starting the actors), when training starts (the restored step of
    a resume) and after every optimizer step, once per step, with the step as the version."""
    from types import SimpleNamespace

    from lightning_wm.callbacks import AgentPublisher
    from lightning_wm.protocols import AgentSink

    class Sink:
        def __init__(self):
            self.versions = []

        def attach_agent(self, agent, version):
            self.versions.append(version)

    sink, module = Sink(), object()
    assert isinstance(sink, AgentSink)
    trainer = SimpleNamespace(datamodule=sink, global_step=0)
    callback = AgentPublisher()
    callback.on_fit_start(trainer, module)
    trainer.global_step = 30  # a resumed run: the step is restored after on_fit_start
    callback.on_train_start(trainer, module)
    for step in range(31, 34):
        trainer.global_step = step
        callback.on_train_batch_end(trainer, module, None, None, step)
        callback.on_train_batch_end(trainer, module, None, None, step)  # same step again: no second attach
    assert sink.versions == [0, 30, 31, 32, 33]
    trainer.datamodule = object()  # a datamodule without the protocol: nothing happens
    callback.on_train_batch_end(trainer, module, None, None, 39)


def test_actors_get_a_new_version_every_publish_every_steps(monkeypatch):
    """The acting part decides what reaches the actors: the first attach starts the pool (with the
    random prefill share of each actor), later versions go out every acting.publish_every steps."""
    from lightning_wm.data.acting import pools as acting_pools

    started, published = [], []

    class Pool:
        copies_weights = True

        def __init__(self, job, module):
            started.append((job.version, job.random_steps))

        def publish(self, module, version):
            published.append(version)

        def close(self):
            pass

    class Agent:
        def acting_copy(self):
            return torch.nn.Identity()

    monkeypatch.setattr(acting_pools, "actor_pool", Pool)
    dm = ReplayDataModule(
        EnvConfig("CartPole-v1", num_envs=2),
        prefill=64,
        replay=ReplaySettings(capacity=1000),
        acting=ActingSettings(num_actors=3, publish_every=3),
    )
    dm.setup("fit")
    for version in range(0, 10):
        dm.attach_agent(Agent(), version)
    assert started == [(0, 11)]  # 64 random rows over 3 actors x 2 envs: 11 vector steps each
    assert published == [3, 6, 9] and dm.acting.learner_version == 9
    dm.teardown("fit")


@pytest.mark.slow
def test_ddp_ranks_with_actors(tmp_path):
    """Two DDP ranks, one actor each: identical weights at the end; every env of every rank's
    actor seeded apart (seeding.env_seeds by rank and actor)."""
    import gymnasium as gym

    from lightning_wm.seeding import env_seeds

    out = subprocess.run(
        [sys.executable, str(ROOT / "tests/support/ddp_fit.py"), str(tmp_path), "ddp", "actors"],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 0, out.stderr[-4000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    for key, value in ranks[0]["weights"].items():
        torch.testing.assert_close(value, ranks[1]["weights"][key], msg=f"weights differ across ranks: {key}")
    for rank in (0, 1):
        assert ranks[rank]["env_steps"] > 32
        for env, seed in enumerate(env_seeds(3, 2, "train", rank, actor=0)):
            expected, _ = gym.make("CartPole-v1").reset(seed=seed)
            torch.testing.assert_close(ranks[rank]["first_obs"][env], torch.as_tensor(expected))


@pytest.mark.slow
def test_resume_with_actors_continues_the_counts():
    """fit, then fit --ckpt_path last: the step and the rows received continue; the resumed buffer
    (not saved here) is prefilled again by the new actors instead of waiting forever."""
    args = [
        "fit",
        *TINY_AGENT,
        "--data.replay_ratio",
        "0.5",
        "--data.acting.num_actors",
        "1",
        "--data.acting.chunk_length",
        "8",
        "--data.acting.timeout_s",
        "240",
        "--trainer.enable_progress_bar",
        "false",
        "--trainer.limit_val_batches",
        "0",
        "--trainer.run_name",
        "resume",
        "--trainer.logger",
        "false",
    ]
    first = main(args=[*args, "--trainer.max_steps", "10"])
    rows = first.datamodule.pop_env_stats().env_steps
    assert rows >= 64 + 10 / 0.5 - 16
    second = main(args=[*args, "--trainer.max_steps", "20", "--ckpt_path", "last"])
    assert second.trainer.global_step == 20
    assert second.datamodule.pop_env_stats().env_steps >= rows + 64, "no new prefill and rows after the resume"


@pytest.mark.slow  # starts a process
def test_terminate_skips_actors_that_never_started():
    """A start that fails part-way (e.g. spawn refused) leaves later actors unstarted; shutting the
    pool down must stop the started ones and not fail on the rest."""
    import multiprocessing as mp

    from lightning_wm.data.acting.spawned import _terminate

    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    started = ctx.Process(target=stop.wait, daemon=True)
    started.start()
    never = ctx.Process(target=stop.wait, daemon=True)
    _terminate([started, never], stop)
    assert not started.is_alive() and started.exitcode is not None
