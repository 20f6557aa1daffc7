"""World Models memory (MDN-RNN): episode resets, masked targets, learning, dreams."""

import gymnasium as gym
import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import TensorBoardLogger

from lightning_wm.agents.worldmodels.memory import Memory
from lightning_wm.agents.worldmodels.vision import Vision, convert_episodes
from lightning_wm.data.episodes import EpisodeStore
from lightning_wm.data.offline import EpisodeDataModule
from lightning_wm.envs import EnvSpec
from lightning_wm.optim import OptimSettings

from support.presets import MEMORY_TINY, VISION_TINY
from support.unit_fit import quiet_trainer

torch.set_num_threads(1)

SPEC = EnvSpec(gym.spaces.Box(0, 255, (64, 64, 3), np.uint8), gym.spaces.Discrete(2), "Synthetic")
# a tiny M with three Gaussians, not the preset's two: a count apart from the 2 actions in shapes
NET = {**MEMORY_TINY["net"], "num_mixtures": 3}


def _batch(b=3, length=6, z=4, border=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    is_first = torch.zeros(b, length, dtype=torch.bool)
    if border is not None:
        is_first[0, border] = True
    is_terminal = torch.zeros(b, length, dtype=torch.bool)
    if border is not None:
        is_terminal[0, border - 1] = True
    return {
        "mu": torch.randn(b, length, z, generator=g),
        "logvar": torch.full((b, length, z), -2.0),
        "action": torch.randint(0, 2, (b, length), generator=g),
        "reward": torch.randn(b, length, generator=g),
        "is_first": is_first,
        "is_last": is_terminal.clone(),
        "is_terminal": is_terminal,
    }


@pytest.mark.parametrize("mixture", ["per_dim", "joint"])
def test_unroll_resets_the_state_where_is_first(mixture):
    m = Memory(SPEC, net={**NET, "mixture": mixture})
    batch = _batch(border=3)
    z, a = batch["mu"], m.action_input(batch["action"])
    out, _ = m.unroll(z, a, batch["is_first"])
    plain, _ = m.lstm(torch.cat([z, a], -1))
    torch.testing.assert_close(out[1:], plain[1:])  # no border: one plain LSTM pass
    torch.testing.assert_close(out[0, :3], plain[0, :3])
    fresh, _ = m.lstm(torch.cat([z, a], -1)[:1, 3:])  # after the border: as if from scratch
    torch.testing.assert_close(out[0, 3:], fresh[0])
    # step-by-step with the public step() agrees
    state = m.initial_state(3)
    for t in range(6):
        if t == 3:
            state = (state[0] * torch.tensor([[0.0], [1], [1]]), state[1] * torch.tensor([[0.0], [1], [1]]))
        h, state = m.step(z[:, t], a[:, t], state)
        torch.testing.assert_close(h, out[:, t])


@pytest.mark.parametrize("mixture", ["per_dim", "joint"])
def test_losses_score_only_targets_inside_an_episode(mixture):
    torch.manual_seed(0)
    m = Memory(SPEC, net={**NET, "mixture": mixture}, sample_z=False)
    batch = _batch(b=2, length=5, border=2)
    losses = m.losses(batch)
    # independent computation: pairs (t -> t+1) inside an episode, state from scratch per episode
    z, a = batch["mu"], m.action_input(batch["action"])
    nll, rew, done, count = 0.0, 0.0, 0.0, 0
    for b in range(2):
        state = m.initial_state(1)
        for t in range(4):
            if batch["is_first"][b, t]:
                state = m.initial_state(1)
            h, state = m.step(z[b : b + 1, t], a[b : b + 1, t], state)
            if batch["is_first"][b, t + 1]:
                continue  # next row starts a new episode: no target
            heads = m.heads(h)
            nll -= m.log_prob(heads, z[b : b + 1, t + 1]).item()
            rew += (heads["reward"].item() - batch["reward"][b, t + 1].item()) ** 2
            y = float(batch["is_terminal"][b, t + 1])
            p = torch.sigmoid(heads["done_logit"]).item()
            done -= y * np.log(p) + (1 - y) * np.log(1 - p)
            count += 1
    assert count == 7
    assert losses["nll"].item() == pytest.approx(nll / count / 4, rel=1e-4)
    assert losses["reward_loss"].item() == pytest.approx(rew / count, rel=1e-4)
    assert losses["done_loss"].item() == pytest.approx(done / count, rel=1e-4)
    # the terminal row (border - 1) is a valid target: the done head is trained on it
    assert batch["is_terminal"][0, 1] and not batch["is_first"][0, 1]


def test_mixture_layouts_have_the_paper_sizes():
    per_dim = Memory(SPEC)  # the paper's sizes are the defaults: z 32, LSTM 256, 5 Gaussians
    assert per_dim.mdn_head.out_features == 3 * 5 * 32 and per_dim.lstm.hidden_size == 256
    assert Memory(SPEC, net={"mixture": "joint"}).mdn_head.out_features == 5 + 2 * 5 * 32
    heads = per_dim.heads(torch.zeros(2, 7, 256))
    assert heads["logit_pi"].shape == (2, 7, 32, 5) and heads["mu"].shape == (2, 7, 32, 5, 1)
    assert per_dim.sample_next(heads).shape == (2, 7, 32)
    with pytest.raises(ValueError, match="action space"):
        Memory(None)


def _dynamics_batch(g, b=16, length=12):
    """z_{t+1} = 0.8 z_t + (a_t ? +0.5 : -0.5) + small noise; done when z_0 crosses 1.5."""
    z = torch.zeros(b, length, 2)
    z[:, 0] = torch.randn(b, 2, generator=g)
    a = torch.randint(0, 2, (b, length), generator=g)
    for t in range(length - 1):
        z[:, t + 1] = 0.8 * z[:, t] + (a[:, t : t + 1].float() - 0.5) + 0.05 * torch.randn(b, 2, generator=g)
    done = z[..., 0] > 1.5
    return {
        "mu": z,
        "logvar": torch.full_like(z, -8.0),
        "action": a,
        "reward": z[..., 1].clone(),
        "is_first": torch.zeros(b, length, dtype=torch.bool),
        "is_last": done,
        "is_terminal": done,
    }


def _train(m: Memory, g: torch.Generator, steps: int, length: int = 12) -> None:
    """``steps`` Adam steps of M's loss on fresh synthetic batches drawn with ``g``."""
    opt = m.configure_optimizers()
    for _ in range(steps):
        loss = m.losses(_dynamics_batch(g, length=length))["loss"]
        opt.zero_grad()
        loss.backward()
        opt.step()


def test_learns_synthetic_dynamics():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    m = Memory(SPEC, net={"latent_dim": 2, "hidden": 32, "num_mixtures": 2}, optim=OptimSettings(lr=1e-2))
    test = _dynamics_batch(torch.Generator().manual_seed(99))
    with torch.no_grad():
        before = m.losses(test)
    _train(m, g, 150)
    with torch.no_grad():
        after = m.losses(test)
    assert after["nll"] < before["nll"] - 1.0, (before["nll"], after["nll"])
    assert after["reward_loss"] < 0.3 * before["reward_loss"]
    assert after["done_loss"] < before["done_loss"]


@pytest.mark.slow  # about a second of training
def test_done_from_the_next_latent():
    """``done_input: latent``: the end is read from z_{t+1} only (the LSTM state cannot raise it),
    and on the synthetic dynamics, where the end is a function of z_{t+1}, it learns the end
    better than the head on M's output in the same steps."""
    m = Memory(SPEC, net={"latent_dim": 2, "hidden": 8, "num_mixtures": 2, "done_input": "latent"})
    heads = m.heads(torch.randn(3, 8))
    assert "done_logit" not in heads
    z_next = torch.randn(3, 2)
    torch.testing.assert_close(m.next_done_logit(heads, z_next), m.next_done_logit(m.heads(torch.randn(3, 8)), z_next))
    torch.testing.assert_close(m.next_done_logit(heads, z_next), m.done_head(z_next).squeeze(-1))
    with pytest.raises(ValueError, match="net.done_input"):
        Memory(SPEC, net={"done_input": "frame"})
    results = {}
    test = _dynamics_batch(torch.Generator().manual_seed(99), b=64)
    for done_input in ("hidden", "latent"):
        torch.manual_seed(0)
        g = torch.Generator().manual_seed(1)
        net = {"latent_dim": 2, "hidden": 32, "num_mixtures": 2, "done_input": done_input}
        m = Memory(SPEC, net=net, optim=OptimSettings(lr=1e-2))
        _train(m, g, 150)
        with torch.no_grad():
            results[done_input] = m.losses(test)
    assert results["latent"]["done_loss"] < 0.5 * results["hidden"]["done_loss"], results
    assert results["latent"]["done_acc"] > 0.97


def test_open_loop_dream_stops_at_the_episode_border():
    m = Memory(SPEC, net=NET)
    batch = _batch(b=2, length=6, border=4)
    dream, valid = m.open_loop_dream(batch["mu"], batch["action"], batch["is_first"], length=5, temperature=0.0)
    assert dream.shape == (2, 5, 4)
    torch.testing.assert_close(dream[:, 0], batch["mu"][:, 0])  # starts from the real latent
    assert valid[0].tolist() == [True, True, True, True, False] and valid[1].all()
    again, _ = m.open_loop_dream(batch["mu"], batch["action"], batch["is_first"], length=5, temperature=0.0)
    torch.testing.assert_close(dream, again)  # temperature 0 is deterministic


@pytest.mark.parametrize("mixture", ["per_dim", "joint"])
def test_open_loop_heads_feed_back_the_mean_after_the_warmup(mixture):
    torch.manual_seed(0)
    m = Memory(
        SPEC,
        net={**NET, "mixture": mixture},
        loss={"open_loop_warmup": 2, "open_loop_input": "mean"},
    )
    batch = _batch(b=2, length=7, border=3)
    z, a = batch["mu"], m.action_input(batch["action"])
    heads, fed_back = m.open_loop_heads(z, batch["action"], batch["is_first"])
    # episode 0: rows 0-2, a new episode from row 3 (warm-up again); episode 1: the whole window
    assert fed_back.tolist() == [[False, False, True, False, False, True], [False, False, True, True, True, True]]
    for b in range(2):  # independent loop: one sequence at a time
        state, previous = m.initial_state(1), None
        since = 0
        for t in range(6):
            if t == 0 or batch["is_first"][b, t]:
                state, since = m.initial_state(1), 0
            else:
                since += 1
            z_in = previous if since >= 2 else z[b : b + 1, t]
            h, state = m.step(z_in, a[b : b + 1, t], state)
            previous = m.mean_next(m.heads(h))
            torch.testing.assert_close(m.mean_next({k: v[b : b + 1, t] for k, v in heads.items()}), previous)


def test_open_loop_loss_is_off_by_default_and_scored_only_on_fed_back_rows():
    torch.manual_seed(0)
    batch = _batch(b=2, length=6, border=3)
    plain = Memory(SPEC, net=NET, sample_z=False)
    assert "open_loop_nll" not in plain.losses(batch)
    torch.manual_seed(0)
    never = Memory(
        SPEC, net=NET, sample_z=False, loss={"open_loop_weight": 1.0, "open_loop_warmup": 6}
    )  # the warm-up covers the window: nothing is fed back, no open-loop term
    with torch.no_grad():
        never.load_state_dict(plain.state_dict())
        a, b = plain.losses(batch), never.losses(batch)
    torch.testing.assert_close(a["loss"], b["loss"])
    assert b["open_loop_nll"].item() == 0.0
    sampled = Memory(SPEC, net=NET, loss={"open_loop_weight": 0.5, "open_loop_warmup": 1})
    losses = sampled.losses(batch)
    expected = (
        losses["nll"]
        + losses["reward_loss"]
        + losses["done_loss"]
        + 0.5 * (losses["open_loop_nll"] + losses["open_loop_reward_loss"] + losses["open_loop_done_loss"])
    )
    torch.testing.assert_close(losses["loss"], expected)
    losses["open_loop_nll"].backward()  # reparameterised draws: the gradient reaches the LSTM's input weights
    assert sampled.lstm.weight_ih_l0.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="loss.open_loop_warmup"):
        Memory(SPEC, loss={"open_loop_warmup": 0})


@pytest.mark.slow  # seconds of training
def test_open_loop_training_improves_multi_step_predictions():
    """On the synthetic dynamics, training with the open-loop loss gives a lower open-loop NLL
    than training the one-step loss alone for the same steps."""
    results = {}
    test = _dynamics_batch(torch.Generator().manual_seed(99), length=16)
    for weight in (0.0, 1.0):
        torch.manual_seed(0)
        g = torch.Generator().manual_seed(1)
        m = Memory(
            SPEC,
            net={"latent_dim": 2, "hidden": 32, "num_mixtures": 2},
            loss={"open_loop_weight": weight, "open_loop_warmup": 2, "open_loop_input": "mean"},
            optim=OptimSettings(lr=1e-2),
        )
        _train(m, g, 100, length=16)
        probe = Memory(
            SPEC,
            net={"latent_dim": 2, "hidden": 32, "num_mixtures": 2},
            loss={"open_loop_weight": 1.0, "open_loop_warmup": 2, "open_loop_input": "mean"},
        )
        probe.load_state_dict(m.state_dict())
        with torch.no_grad():
            results[weight] = probe.losses(test)["open_loop_nll"].item()
    assert results[1.0] < results[0.0], results


@pytest.mark.slow
def test_fit_on_a_converted_store_logs_losses_and_a_dream_image(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from lightning_wm.data.offline import EpisodeDataModule

    rng = np.random.default_rng(0)
    pixels = EpisodeStore(tmp_path / "pixels")
    for _ in range(4):
        n = 10
        flags = np.zeros(n, bool)
        first, last = flags.copy(), flags.copy()
        first[0], last[-1] = True, True
        pixels.add(
            {
                "obs": rng.integers(0, 256, (n, 64, 64, 3), dtype=np.uint8),
                "action": rng.integers(0, 2, n),
                "reward": np.ones(n, np.float32),
                "is_first": first,
                "is_last": last,
                "is_terminal": last,
            }
        )
    vision = Vision(SPEC, **VISION_TINY)
    vision_ckpt = str(tmp_path / "v.ckpt")
    torch.save(
        {
            "state_dict": vision.state_dict(),
            "hyper_parameters": dict(vision.hparams),
            "pytorch-lightning_version": pl.__version__,
        },
        vision_ckpt,
    )
    latents = EpisodeStore(tmp_path / "latents")
    assert convert_episodes(vision, pixels, latents) == 4

    dm = EpisodeDataModule(
        str(tmp_path / "latents"),
        mode="sequences",
        batch_size=4,
        sequence_length=8,
        val_fraction=0.25,
        train_batches=3,
        val_batches=1,
    )
    model = Memory(
        SPEC,
        net={"latent_dim": 4, "hidden": 16, "num_mixtures": 2},
        dream={"length": 6, "sequences": 2},
        vision_ckpt=vision_ckpt,
    )
    logger = TensorBoardLogger(str(tmp_path / "logs"), name="m")
    trainer = quiet_trainer(
        max_epochs=1,
        logger=logger,
        num_sanity_val_steps=0,
        log_every_n_steps=1,
    )
    trainer.fit(model, datamodule=dm)
    for key in ("val/nll", "val/reward_loss", "val/done_loss"):
        assert torch.isfinite(trainer.callback_metrics[key])
    events = EventAccumulator(logger.log_dir, size_guidance={"images": 0})
    events.Reload()
    for tag in ("val/real_vs_dream", "val/dream_latent_error"):  # add_figure writes images
        image = events.Images(tag)[-1]
        assert image.width > 0 and image.height > 0


def test_dream_figures_label_the_real_and_dreamed_rows_and_the_error_curves(monkeypatch):
    """What log_dream draws: rows "real i" / "dream i" with columns t=0.., and the open-loop latent
    error per step, a curve per sequence and their mean, with axis labels and a legend."""
    import lightning_wm.agents.worldmodels.memory as memory_module

    figures = {}
    monkeypatch.setattr(memory_module, "log_figure", lambda module, tag, make: figures.update({tag: make()}))
    m = Memory(SPEC, net=NET, dream={"length": 5, "sequences": 2}, vision_ckpt="v.ckpt")
    m._vision.append(Vision(SPEC, **VISION_TINY))
    m.log_dream(_batch(b=3, length=6, border=3))
    frames = figures["val/real_vs_dream"]
    axes = frames.get_axes()
    assert len(axes) == 4 * 5
    assert [ax.get_ylabel() for ax in axes[::5]] == ["real 0", "dream 0", "real 1", "dream 1"]
    assert [ax.get_title() for ax in axes[:5]] == [f"t={t}" for t in range(5)]
    (curves,) = figures["val/dream_latent_error"].get_axes()
    assert curves.get_xlabel().startswith("open-loop step") and "z" in curves.get_ylabel()
    assert [t.get_text() for t in curves.get_legend().get_texts()] == ["sequence 0", "sequence 1", "mean"]
    first = curves.get_lines()[0].get_ydata()
    assert first[0] == 0.0 and np.isnan(first[3:]).all()  # starts on the real latent; ends at the border


@pytest.mark.slow
def test_patience_stops_training_when_the_validation_loss_stops_falling(tmp_path, capsys):
    """HumbleRL's patience: Lightning's EarlyStopping on val/loss. With a learning rate too small
    to move a weight (and z = mu) the validation loss never falls after the first epoch: patience 2
    stops after epoch 3 of 20."""
    from pytorch_lightning.callbacks import EarlyStopping

    from lightning_wm.data.offline import EpisodeDataModule

    rng = np.random.default_rng(0)
    latents = EpisodeStore(tmp_path / "latents")
    for _ in range(4):
        flags = np.zeros(10, bool)
        first, last = flags.copy(), flags.copy()
        first[0], last[-1] = True, True
        latents.add(
            {
                "mu": rng.normal(size=(10, 4)).astype(np.float32),
                "logvar": np.zeros((10, 4), np.float32),
                "action": rng.integers(0, 2, 10),
                "reward": np.ones(10, np.float32),
                "is_first": first,
                "is_last": last,
                "is_terminal": last,
            }
        )
    dm = EpisodeDataModule(
        str(tmp_path / "latents"),
        mode="sequences",
        batch_size=2,
        sequence_length=6,
        val_fraction=0.25,
        train_batches=2,
        val_batches=1,
    )
    frozen = OptimSettings(name="sgd", lr=1e-30)
    model = Memory(
        SPEC, net={"latent_dim": 4, "hidden": 8, "num_mixtures": 2}, optim=frozen, sample_z=False, patience=2
    )
    trainer = quiet_trainer(
        max_epochs=20,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, datamodule=dm)
    stopper = next(c for c in trainer.callbacks if isinstance(c, EarlyStopping))
    assert (stopper.monitor, stopper.mode, stopper.patience) == ("val/loss", "min", 2)
    assert trainer.current_epoch == 3 and stopper.stopped_epoch == 2
    # and says so: a fit cut short is never taken for a finished one
    said = capsys.readouterr().err
    assert "early stopping: val/loss has not gone below" in said and "stopped after epoch 3 of 20" in said
    # no patience: no early stopping; HumbleRL's defaults are 10 (M) and 5 (V)
    assert Memory(SPEC, net=NET, patience=None).configure_callbacks() == []
    assert Memory(SPEC, net=NET).patience == 10 and Vision(SPEC, **VISION_TINY).patience == 5
    (vision_stop,) = Vision(SPEC, **VISION_TINY).configure_callbacks()
    assert (vision_stop.monitor, vision_stop.mode, vision_stop.patience) == ("val/loss", "min", 5)
    with pytest.raises(ValueError, match="patience"):
        Memory(SPEC, net=NET, patience=0)


def test_mdn_rnn_loss_hand_checked():
    """Rows 0 and 1 scored, row 2 not; Z = 2, reward weight 0.5, done weight 2, positive class x3."""
    import math

    from lightning_wm.agents.worldmodels.losses import mdn_rnn_loss

    out = mdn_rnn_loss(
        log_prob=torch.tensor([[-2.0, -4.0, -100.0]]),
        reward=torch.tensor([[1.0, 0.0, 5.0]]),
        reward_target=torch.zeros(1, 3),
        done_logit=torch.tensor([[0.0, -math.log(3.0), 7.0]]),
        done_target=torch.tensor([[1.0, 0.0, 0.0]]),
        valid=torch.tensor([[True, True, False]]),
        latent_dim=2,
        reward_weight=0.5,
        done_weight=2.0,
        done_pos_weight=3.0,
    )
    nll = (2.0 + 4.0) / 2 / 2  # per row, per latent dimension
    reward = (1.0 + 0.0) / 2
    # row 0: terminal, p = 1/2 -> 3 * log 2; row 1: not terminal, p = 1/4 -> -log(3/4)
    done = (3 * math.log(2.0) + math.log(4.0 / 3.0)) / 2
    assert out["nll"].item() == pytest.approx(nll)
    assert out["reward_loss"].item() == pytest.approx(reward)
    assert out["done_loss"].item() == pytest.approx(done, rel=1e-6)
    assert out["done_acc"].item() == pytest.approx(0.5)  # row 0 says "not terminal" (logit 0), row 1 right
    assert out["loss"].item() == pytest.approx(nll + 0.5 * reward + 2.0 * done, rel=1e-6)
    nothing = mdn_rnn_loss(*(torch.ones(1, 2) for _ in range(5)), torch.zeros(1, 2, dtype=torch.bool), 2)
    assert nothing["loss"].item() == 0.0  # no valid row: zero, not NaN


def test_optim_clip_bounds_the_gradient_norm_and_excludes_the_trainers():
    clip = {"lr": 1e-3, "clip": {"type": "clip_norm", "value": 1e-3}}
    m = Memory(SPEC, net=NET, optim=clip)
    assert m.hparams["optim"]["clip"]["type"] == "clip_norm"  # stored as plain dicts
    opt = m.configure_optimizers()
    m.losses(_batch())["loss"].backward()
    m.configure_gradient_clipping(opt)
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in m.parameters() if p.grad is not None]))
    assert norm.item() == pytest.approx(1e-3, rel=1e-4)
    with pytest.raises(ValueError, match="gradient_clip_val"):
        m.configure_gradient_clipping(opt, gradient_clip_val=1.0)


def test_episode_forward_mean_hand_checked_and_against_a_loop():
    from lightning_wm.agents.worldmodels.losses import episode_forward_mean

    reward = torch.tensor([[1.0, 2.0, 3.0, 10.0, 20.0]])
    is_first = torch.tensor([[True, False, False, True, False]])  # a new episode at row 3
    got = episode_forward_mean(reward, is_first, 3)
    # row 0: (1+2+3)/3; row 1: (2+3)/2, row 3 is the next episode's; row 2: 3; row 3: (10+20)/2; row 4: 20
    torch.testing.assert_close(got, torch.tensor([[2.0, 2.5, 3.0, 15.0, 20.0]]))
    torch.testing.assert_close(episode_forward_mean(reward, is_first, 1), reward)
    g = torch.Generator().manual_seed(0)
    reward, is_first = torch.randn(4, 30, generator=g), torch.rand(4, 30, generator=g) < 0.1
    for horizon in (2, 7, 40):
        expected = torch.empty_like(reward)
        for b in range(4):
            for t in range(30):
                end = t + 1
                while end < min(t + horizon, 30) and not is_first[b, end]:
                    end += 1
                expected[b, t] = reward[b, t:end].mean()
        torch.testing.assert_close(episode_forward_mean(reward, is_first, horizon), expected)


def test_the_reward_head_is_scored_on_the_forward_mean_with_a_reward_horizon():
    torch.manual_seed(0)
    batch = _batch(b=2, length=5, border=2)
    batch["reward"] = torch.randn(2, 5)
    one = Memory(SPEC, net=NET, sample_z=False)
    three = Memory(SPEC, net=NET, sample_z=False, loss={"reward_horizon": 3})
    three.load_state_dict(one.state_dict())
    from lightning_wm.agents.worldmodels.losses import episode_forward_mean

    smoothed = {**batch, "reward": episode_forward_mean(batch["reward"], batch["is_first"].bool(), 3)}
    assert three.losses(batch)["reward_loss"].item() == pytest.approx(one.losses(smoothed)["reward_loss"].item())
    assert three.losses(batch)["reward_loss"].item() != pytest.approx(one.losses(batch)["reward_loss"].item())


def test_a_folder_without_its_env_is_named_in_the_error(tmp_path):
    """Episodes copied into a new folder without meta.json: the one-line error says what to copy."""
    store = EpisodeStore(tmp_path / "merged")
    store.add({"z": np.zeros((3, 2), np.float32), "action": np.zeros((3, 1), np.float32)})
    data = EpisodeDataModule(str(tmp_path / "merged"), mode="sequences")
    with pytest.raises(ValueError, match="no meta.json"):
        Memory(data.spec, **MEMORY_TINY)
