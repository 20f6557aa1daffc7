"""``acting.fetch_ahead: false``: each batch is made just before the step that trains on it
(Lightning's fetcher, one batch ahead, only gets a placeholder), so in process the rows come from
the weights being trained, counts stay exact and a resume neither repeats nor skips a batch."""

import pytest
import pytorch_lightning as pl
from pytorch_lightning.utilities.model_helpers import is_overridden

from lightning_wm.agents.impala import IMPALA, ActorCriticSettings
from lightning_wm.cli import main
from lightning_wm.data.modules import UnrollDataModule
from lightning_wm.data.online import BatchAtStep
from lightning_wm.envs import EnvConfig

from support.presets import IMPALA_TINY, TINY_FIT
from support.unit_fit import fit_quietly


def _datamodule(fetch_ahead: bool) -> UnrollDataModule:
    return UnrollDataModule(
        EnvConfig("CartPole-v1", num_envs=2, seed=0),
        unroll_length=4,
        batch_size=2,
        acting={"fetch_ahead": fetch_ahead},
    )


def test_the_stream_yields_placeholders_that_become_batches_only_at_the_transfer():
    assert not is_overridden("on_before_batch_transfer", _datamodule(fetch_ahead=True))  # Lightning's hook
    dm = _datamodule(fetch_ahead=False)
    assert is_overridden("on_before_batch_transfer", dm)
    model = IMPALA(dm.spec, net=ActorCriticSettings(**IMPALA_TINY["net"]))
    dm.setup("fit")
    dm.attach_agent(model, 0)
    try:
        stream = iter(dm.train_dataloader())
        placeholders = [next(stream), next(stream)]
        assert all(isinstance(p, BatchAtStep) for p in placeholders)
        assert dm.env_steps == 0, "a placeholder acted"
        batch = dm.on_before_batch_transfer(placeholders[0], 0)
        assert batch["obs"].shape == (2, 5, 4) and dm.env_steps == 2 * 5  # 2 envs, one unroll of T + 1 rows
        evaluation = [{"return": 1.0}]
        assert dm.on_before_batch_transfer(evaluation, 0) is evaluation  # other batches pass through
    finally:
        dm.teardown("fit")


class _OwnHook(IMPALA):
    """A model with its own ``on_before_batch_transfer``, as a user's augmentation would have."""

    def on_before_batch_transfer(self, batch, dataloader_idx):
        batch["seen_by_model_hook"] = True
        return batch


def _policy_versions(fetch_ahead: bool, steps: int = 5) -> list[tuple[int, set[int]]]:
    """(global step, the policy versions of the rows acted for the batch) of every training batch;
    an unroll's first row is the one it shares with the unroll before (acted then). The model's
    own ``on_before_batch_transfer`` must see every batch."""
    pl.seed_everything(0)
    dm = _datamodule(fetch_ahead)
    model = _OwnHook(dm.spec, net=ActorCriticSettings(**IMPALA_TINY["net"]))
    seen: list[tuple[int, set[int]]] = []

    class Record(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            assert batch.pop("seen_by_model_hook") is True
            seen.append((trainer.global_step, set(batch["policy_version"][:, 1:-1].flatten().tolist())))

    fit_quietly(model, dm, steps, Record())
    batches = steps + int(fetch_ahead)  # the batch fetched ahead was acted for
    assert dm.env_steps == 2 * (4 * batches + 1)  # 2 envs, unrolls of T + 1 rows overlapping by one
    return seen


@pytest.mark.slow
def test_in_process_rows_come_from_the_weights_they_train_without_the_fetch_ahead():
    at_step = _policy_versions(fetch_ahead=False)
    assert [versions for _, versions in at_step] == [{step} for step, _ in at_step]  # lag 0
    ahead = _policy_versions(fetch_ahead=True)
    assert [versions for _, versions in ahead[1:]] == [{step - 1} for step, _ in ahead[1:]]  # lag 1


@pytest.mark.slow
def test_fit_then_resume_takes_each_batch_once_without_the_fetch_ahead():
    args = ["fit", *TINY_FIT, "--data.replay.save", "true", "--data.acting.fetch_ahead", "false"]
    cli = main(args=[*args, "--trainer.max_steps", "12", "--trainer.checkpoint_every_n_steps", "6"])
    # 64 prefill rows + 2 rows per batch (replay ratio 0.5), one batch per step, none ahead
    assert cli.datamodule.collector.stats.env_steps == 64 + 12 * 2
    cli = main(args=[*args, "--trainer.max_steps", "20", "--ckpt_path", "last"])
    assert cli.trainer.global_step == 20
    assert cli.datamodule.collector.stats.env_steps == 64 + 20 * 2
