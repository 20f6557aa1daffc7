"""MuZeroRepresentation: windows cut from unroll batches, its MuZero loss, detached or not, its
schedule, and IMPALA using it as its encoder from YAML."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_wm.agents.impala import IMPALA, ActorCriticSettings, unroll_loss
from lightning_wm.agents.muzero import MuZeroLossSettings, MuZeroNet, MuZeroRepresentation, UnrollSettings
from lightning_wm.agents.muzero.representation import unroll_windows
from lightning_wm.envs import EnvConfig, env_spec
from lightning_wm.optim import GradClipSettings, OptimSettings

from support.presets import IMPALA_TINY, UNROLL_DATA_TINY, data_overrides

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[1]


def unroll_batch(B: int = 2, L: int = 6, seed: int = 0) -> dict[str, torch.Tensor]:
    """Unrolls in the row convention: sample 0 ends (terminates) at row 2 and restarts at row 3;
    sample 1 runs on to a truncation at row 4 and restarts at row 5."""
    g = torch.Generator().manual_seed(seed)
    is_last = torch.zeros(B, L, dtype=torch.bool)
    is_terminal = torch.zeros(B, L, dtype=torch.bool)
    is_first = torch.zeros(B, L, dtype=torch.bool)
    is_last[0, 2] = is_terminal[0, 2] = is_first[0, 3] = True
    if B > 1:
        is_last[1, 4] = is_first[1, 5] = True
    return {
        "obs": torch.randn(B, L, 4, generator=g),
        "action": torch.randint(0, 2, (B, L), generator=g),
        "reward": torch.ones(B, L),
        "is_first": is_first,
        "is_last": is_last,
        "is_terminal": is_terminal,
        "logits": torch.randn(B, L, 2, generator=g),
    }


def test_windows_hold_each_positions_episode():
    batch = unroll_batch()
    windows, ok = unroll_windows(batch, 4)
    assert windows["obs"].shape == (2 * 5, 4, 4)
    mask = windows["mask"].long().tolist()
    # sample 0: rows 0..2 are one episode (2 terminal), rows 3..5 the next
    assert mask[0:5] == [[1, 1, 1, 0], [1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 0], [1, 1, 0, 0]]
    # sample 1: rows 0..4 one episode (4 truncated), row 5 the next one
    assert mask[5:10] == [[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 0, 0], [1, 0, 0, 0]]
    assert ok.tolist() == [True, True, False, True, True, True, True, True, True, False]
    # position p of unroll b: its rows p.. of the unroll, zeros past the end
    torch.testing.assert_close(windows["obs"][5 + 3, :3], batch["obs"][1, 3:6])
    assert torch.equal(windows["obs"][5 + 3, 3], torch.zeros(4))
    assert windows["action"][1].tolist() == batch["action"][0, 1:5].tolist()


def _repr(loss: MuZeroLossSettings | None = None, **kwargs) -> MuZeroRepresentation:
    spec = env_spec(EnvConfig("CartPole-v1"))
    net = MuZeroNet(latent_dim=8, hidden=16, layers=1, head_hidden=8, support_size=5)
    return MuZeroRepresentation(spec, net=net, unroll=UnrollSettings(2, 2), loss=loss or MuZeroLossSettings(), **kwargs)


def test_representation_loss_trains_the_whole_model_and_the_schedule():
    torch.manual_seed(0)
    rep = _repr(MuZeroLossSettings(train_repr_prediction=True), interval=2)
    with torch.no_grad():  # heads away from their zero init
        for p in rep.parameters():
            p.add_(0.1 * torch.randn_like(p))
    assert rep(torch.zeros(3, 4)).shape == (3, rep.out_dim) and rep.out_dim == 8
    assert rep.representation_loss(unroll_batch(), step=1) is None  # interval 2: odd steps skipped
    loss, logs = rep.representation_loss(unroll_batch(), step=2)
    assert set(logs) == {
        "repr/loss",
        "repr/value_loss",
        "repr/reward_loss",
        "repr/policy_loss",
        "repr/repr_loss",
        "repr/feature_std",
    }
    batch = unroll_batch()
    features = rep.model.representation(batch["obs"].flatten(0, 1))
    torch.testing.assert_close(logs["repr/feature_std"], features.std(0).mean())
    assert logs["repr/feature_std"] > 0
    loss.backward()
    for name in ("repr_net", "dyn_net", "pred_net", "reward_head", "value_head", "policy_head"):
        grads = [p.grad for n, p in rep.model.named_parameters() if n.startswith(name)]
        assert grads and any(g is not None and g.abs().sum() > 0 for g in grads), name
    with pytest.raises(ValueError, match="train_policy"):
        rep.representation_loss({k: v for k, v in unroll_batch().items() if k != "logits"}, step=0)
    with pytest.raises(ValueError, match="bootstrap_value must be 'target_network'"):
        MuZeroRepresentation(rep_spec(), unroll={"bootstrap_value": "stored"})
    with pytest.raises(ValueError, match="frame_stack must be 1"):
        MuZeroRepresentation(rep_spec(), net={"frame_stack": 2})


def rep_spec():
    return env_spec(EnvConfig("CartPole-v1"))


@pytest.mark.parametrize("detach", [True, False])
def test_host_gradients_reach_the_representation_only_when_not_detached(detach):
    torch.manual_seed(1)
    spec = env_spec(EnvConfig("CartPole-v1"))
    host = IMPALA(spec, net=ActorCriticSettings(**IMPALA_TINY["net"]), encoder=lambda s: _repr(detach=detach))
    batch = unroll_batch()
    unroll_loss(host.net, batch).total_loss.backward()
    grads = [p.grad for p in host.net.encoder.model.repr_net.parameters()]
    assert any(g is not None and g.abs().sum() > 0 for g in grads) == (not detach)
    # the host's training step adds the representation's loss
    host.zero_grad()
    host.log_dict = host.log = lambda *a, **k: None
    out = host.training_step(batch, 0)
    expected = unroll_loss(host.net, batch).total_loss + host.net.encoder.representation_loss(batch, 0)[0]
    torch.testing.assert_close(out["loss"], expected)
    # and so does the loss a composing learner (DynaLearner) takes, at the step it passes
    loss, logs = host.learner_loss(batch, step=0)
    torch.testing.assert_close(loss, expected)
    assert "repr/loss" in logs


@pytest.mark.parametrize("clip", ["clip_momentum", "clip_momentum_norm"])
def test_interval_with_momentum_clipping_skips_the_idle_representation(clip):
    """``interval: 2``: on odd steps the MuZero model gets no gradient (detached features), so the
    host's momentum clipper sees fewer gradients than on even steps; it keeps each parameter's
    estimate and leaves the idle ones as they were (this crashed: "GradClipper got 10 gradients
    after 47")."""
    torch.manual_seed(2)
    spec = env_spec(EnvConfig("CartPole-v1"))
    optim = OptimSettings(clip=GradClipSettings(type=clip, momentum_timestep=1))
    host = IMPALA(spec, net=ActorCriticSettings(**IMPALA_TINY["net"]), optim=optim, encoder=lambda s: _repr(interval=2))
    model_params = list(host.net.encoder.model.parameters())
    batch = unroll_batch()
    for step in range(4):
        host.zero_grad(set_to_none=True)
        host.learner_loss(batch, step=step)[0].backward()
        idle = step % 2 == 1
        assert all((p.grad is None) == idle for p in model_params)
        estimate = [a.clone() for a in host.clipper.square_avg]
        host.clipper(host.parameters())
        if idle:  # the model's estimates stay as they were, the heads' move on
            owned = {id(p) for p in model_params}
            for p, before, after in zip(host.parameters(), estimate, host.clipper.square_avg):
                assert torch.equal(before, after) == (id(p) in owned)
    counts = dict(zip((id(p) for p in host.parameters()), host.clipper.counts))
    assert {counts[id(p)] for p in model_params} == {2}
    assert {c for k, c in counts.items() if k not in {id(p) for p in model_params}} == {4}


@pytest.mark.slow
def test_impala_with_the_muzero_representation_from_yaml():
    from lightning_wm.cli import main

    cli = main(
        args=[
            "fit",
            "--config",
            str(ROOT / "configs/impala/cartpole_muzero_repr.yaml"),
            "--trainer.max_steps",
            "3",
            "--trainer.val_check_interval",
            "3",
            "--trainer.log_every_n_steps",
            "1",
            "--trainer.enable_progress_bar",
            "false",
            "--trainer.run_name",
            "run",
            "--data.init_args.acting.num_actors",
            "0",
            *data_overrides(UNROLL_DATA_TINY),
        ]
    )
    assert cli.trainer.global_step == 3
    encoder = cli.model.net.encoder
    assert isinstance(encoder, MuZeroRepresentation) and cli.model.net.value.in_features == encoder.out_dim
    metrics = cli.trainer.logged_metrics
    assert "repr/loss" in metrics and "repr/reward_loss" in metrics and "val/return" in metrics
