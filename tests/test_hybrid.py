"""Hybrid Dyna (DI-engine's HybridWorldModel used by a learner): the dream loss against hand-checked
values, DynaLearner's dream (gradients into the policy only, through the frozen model), its checks,
and configs/impala/cartpole_hybrid.yaml from the command line with both uses of the model."""

from pathlib import Path

import pytest
import torch

from lightning_wm.agents.dreamer import Dreamer
from lightning_wm.agents.dyna import DreamSettings, DynaLearner, DynaWorldModel, HybridWorldModel, dream_loss
from lightning_wm.agents.impala import IMPALA
from lightning_wm.cli import main
from lightning_wm.envs import EnvConfig, env_spec

from support.presets import DREAMER_TINY, IMPALA_TINY, UNROLL_DATA_TINY, data_overrides, overrides

ROOT = Path(__file__).resolve().parents[1]
CARTPOLE = env_spec(EnvConfig(id="CartPole-v1"))


def test_dream_loss_by_hand():
    # N = 2 imagined steps, one dream; gamma_t = 0.9 (1 - done_t) = [0.72, 0.45], rewards + bonus = [1.1, 2.2]
    # G_1 = 2.2 + 0.45 * 3 = 3.55;  G_0 = 1.1 + 0.72 * (0.5 * 1 + 0.5 * 3.55) = 2.738
    # alive = [1, 1 - 0.2];  loss = -(2.738 + 0.8 * 3.55) / 2 = -2.789
    reward = torch.tensor([[1.0], [2.0]])
    value = torch.tensor([[0.5], [1.0], [3.0]], requires_grad=True)
    done = torch.tensor([[0.2], [0.5]])
    bonus = torch.tensor([[0.1], [0.2], [0.3]])
    loss, returns = dream_loss(reward, value, done, bonus, discount=0.9, lambda_=0.5)
    torch.testing.assert_close(returns, torch.tensor([[2.738], [3.55]]))
    torch.testing.assert_close(loss, torch.tensor(-2.789))
    loss.backward()  # d loss / d V_1 = -(0.72 * 0.5) / 2; d / d V_2 = -(0.72 * 0.5 * 0.45 + 0.8 * 0.45) / 2
    torch.testing.assert_close(value.grad, torch.tensor([[0.0], [-0.18], [-0.261]]))
    with pytest.raises(ValueError, match="at least one imagined step"):
        dream_loss(reward[:0], value[:1], done[:0], bonus[:1], 0.9, 0.5)


def _learner(weight: float = 0.5, **policy) -> DynaLearner:
    return DynaLearner(
        CARTPOLE,
        policy=lambda s: IMPALA(s, net={**IMPALA_TINY["net"], **policy}),
        world_model=lambda s: Dreamer(s, **DREAMER_TINY),
        rollout={"start_step": 0, "end_step": 0, "min_length": 3, "max_length": 3},
        imagination={"real_ratio": 0.5, "rollout_batch_size": 8, "burn_in": 2},
        dream={"weight": weight, "batch_size": 3},
        seed=0,
    )


def _model_batch(batch: int = 4, length: int = 6) -> dict[str, torch.Tensor]:
    """Real sequences ``[B, L, ...]`` of CartPole's shapes (what the model replay hands Dyna)."""
    gen = torch.Generator().manual_seed(0)
    is_first = torch.zeros(batch, length, dtype=torch.bool)
    is_first[:, 0] = True
    return {
        "obs": torch.randn(batch, length, 4, generator=gen),
        "action": torch.randint(0, 2, (batch, length), generator=gen),
        "is_first": is_first,
    }


def test_dream_trains_the_policy_through_the_frozen_model():
    torch.manual_seed(0)
    learner = _learner()
    flags = [p.requires_grad for p in learner.parameters()]  # (Dreamer's slow critic never requires grad)
    assert isinstance(learner.dyna, HybridWorldModel) and isinstance(_learner(0.0).dyna, DynaWorldModel)
    assert not isinstance(_learner(0.0).dyna, HybridWorldModel)  # weight 0: Dyna alone
    loss, logs = learner.dream_loss(_model_batch())
    assert torch.isfinite(loss) and float(logs["train/dream_horizon"]) == 3.0
    loss.backward()
    policy_grads = [p.grad for p in learner.policy.net.head.parameters()]
    assert all(g is not None and g.abs().sum() > 0 for g in policy_grads), "the actor learns from the dream"
    assert learner.policy.net.value.weight.grad is None, "the value function is not trained by the dream"
    assert all(p.grad is None for p in learner.world_model.wm.parameters()), "the model is frozen in a dream"
    assert [p.requires_grad for p in learner.parameters()] == flags, "frozen only while dreaming"


class NoDreams(torch.nn.Module):
    """A policy learner with all Dyna needs but no ``dream_*`` methods (IMPALA's, delegated)."""

    def __init__(self, spec):
        super().__init__()
        self.inner = IMPALA(spec, net=IMPALA_TINY["net"])
        self.act, self.initial_state = self.inner.act, self.inner.initial_state
        self.learner_loss, self.configure_optimizers = self.inner.learner_loss, self.inner.configure_optimizers


def test_dream_settings_and_what_a_dream_needs():
    with pytest.raises(ValueError, match="dream.weight must be >= 0"):
        DreamSettings(weight=-1.0)
    with pytest.raises(ValueError, match="dream.batch_size must be >= 1"):
        DreamSettings(batch_size=0)
    with pytest.raises(ValueError, match="net.lstm_size: 0"):
        _learner(lstm_size=8).dream_loss(_model_batch())
    with pytest.raises(ValueError, match=r"lacks \['dream_act'.*needed by dream.weight > 0"):
        DynaLearner(
            CARTPOLE,
            policy=NoDreams,
            world_model=lambda s: Dreamer(s, **DREAMER_TINY),
            dream={"weight": 1.0},
        )


@pytest.mark.slow
def test_cartpole_hybrid_config_fits_with_imagined_rows_and_dreams():
    cli = main(
        args=[
            "fit",
            "--config",
            str(ROOT / "configs/impala/cartpole_hybrid.yaml"),
            *"--seed_everything 1 --trainer.max_steps 10 --trainer.val_check_interval 10".split(),
            *"--trainer.log_every_n_steps 1 --trainer.enable_progress_bar false --trainer.run_name run".split(),
            *data_overrides(UNROLL_DATA_TINY),
            *"--data.init_args.batch_size 4 --data.init_args.model_replay.capacity 1000".split(),
            *"--data.init_args.model_replay.batch_size 2 --data.init_args.model_replay.sequence_length 12".split(),
            *"--model.init_args.model_train_start 16 --model.init_args.train_freq 16".split(),
            *"--model.init_args.rollout.min_length 3 --model.init_args.rollout.max_length 3".split(),
            *"--model.init_args.imagination.rollout_batch_size 8 --model.init_args.imagination.real_ratio 0.5".split(),
            *overrides({"net": DREAMER_TINY["net"]}, "--model.init_args.world_model.init_args"),
        ]
    )
    logged = cli.trainer.logged_metrics
    assert isinstance(cli.model.dyna, HybridWorldModel) and cli.trainer.global_step == 10
    assert float(logged["imagination/rows"]) > 0, "imagined rows: the buffer was filled"
    assert float(logged["train/dream_horizon"]) == 3.0 and torch.isfinite(logged["train/dream_loss"])
    assert "val/return" in logged
