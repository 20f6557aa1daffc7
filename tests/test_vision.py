"""World Models vision: VAE loss terms, the model's shapes, a tiny fit with a TensorBoard figure,
and convert_episodes into a latent store."""

import math

import gymnasium as gym
import numpy as np
import pytest
import torch
from pytorch_lightning.loggers import TensorBoardLogger

from lightning_wm.agents.worldmodels.losses import vae_loss
from lightning_wm.agents.worldmodels.vision import Vision, convert_episodes, encode_frames
from lightning_wm.data.episodes import EpisodeStore
from lightning_wm.envs import EnvSpec
from lightning_wm.logging import image_grid
from lightning_wm.optim import OptimSettings

from support.presets import VISION_TINY
from support.unit_fit import quiet_trainer

torch.set_num_threads(1)

PIXELS = EnvSpec(gym.spaces.Box(0, 255, (64, 64, 3), np.uint8), gym.spaces.Discrete(2), "Synthetic")


def test_kl_term_hand_checked():
    # KL(N(1, 1) || N(0, 1)) = 0.5; KL(N(0, 4) || N(0, 1)) = 0.5 * (4 - 1 - log 4)
    mu, logvar = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, math.log(4.0)]])
    img = torch.zeros(1, 3, 2, 2)
    out = vae_loss(img, img, mu, logvar, kl_tolerance=0.0)
    expected = 0.5 + 0.5 * (3.0 - math.log(4.0))
    assert out["kl"].item() == pytest.approx(expected, abs=1e-6)
    assert out["loss"].item() == pytest.approx(expected, abs=1e-6)  # perfect reconstruction


def test_reconstruction_term_is_sum_over_pixels_mean_over_frames():
    recon = torch.zeros(2, 1, 2, 2)
    target = torch.tensor([0.5, 0.5, 0.0, 0.0, 0.1, 0.0, 0.0, 0.0]).view(2, 1, 2, 2)
    out = vae_loss(recon, target, torch.zeros(2, 4), torch.zeros(2, 4), kl_tolerance=0.0)
    assert out["recon"].item() == pytest.approx((0.25 + 0.25 + 0.01) / 2)
    assert out["mse"].item() == pytest.approx((0.25 + 0.25 + 0.01) / 8)
    assert out["kl"].item() == 0.0


def test_free_bits_floor_per_frame():
    # latent_dim 4, tolerance 0.5 -> floor 2 nats. Frame 0 has KL 0.5 (below), frame 1 KL 8 (above).
    mu = torch.tensor([[1.0, 0.0, 0.0, 0.0], [2.0, 2.0, 2.0, 2.0]], requires_grad=True)
    logvar = torch.zeros(2, 4, requires_grad=True)
    img = torch.zeros(2, 1, 1, 1)
    out = vae_loss(img, img, mu, logvar, kl_tolerance=0.5)
    assert out["kl"].item() == pytest.approx((0.5 + 8.0) / 2)
    assert out["kl_floored"].item() == pytest.approx((2.0 + 8.0) / 2)
    out["loss"].backward()
    assert torch.all(mu.grad[0] == 0)  # floored: no pressure below the free bits
    torch.testing.assert_close(mu.grad[1], mu[1].detach() / 2)  # d/dmu (0.5 mu^2) / batch
    no_floor = vae_loss(img, img, mu, logvar, kl_tolerance=0.0)
    assert no_floor["loss"].item() == pytest.approx(4.25)


def test_vision_shapes_and_channels_from_spec():
    model = Vision(PIXELS, latent_dim=8, depth=4)
    obs = torch.randint(0, 256, (5, 64, 64, 3), dtype=torch.uint8)
    mu, logvar = model.encode(obs)
    assert mu.shape == logvar.shape == (5, 8)
    recon, _, _ = model(obs)
    assert recon.shape == (5, 3, 64, 64)
    sig = Vision(PIXELS, latent_dim=8, depth=4, output="sigmoid")(obs)[0]
    assert sig.min() >= -0.5 and sig.max() <= 0.5
    assert model.decode_frames(mu).shape == (5, 64, 64, 3)
    gray = EnvSpec(gym.spaces.Box(0, 255, (64, 64, 1), np.uint8), gym.spaces.Discrete(2))
    assert Vision(gray, latent_dim=8, depth=4).hparams["image_channels"] == 1
    vector = EnvSpec(gym.spaces.Box(-1, 1, (4,), np.float32), gym.spaces.Discrete(2), "CartPole-v1")
    with pytest.raises(ValueError, match="pixels: true"):
        Vision(vector)


def test_image_grid_layout():
    a = torch.zeros(3, 4, 5, 2, dtype=torch.uint8)
    b = torch.full((3, 4, 5, 2), 7, dtype=torch.uint8)
    b[1, 0, 0, 1] = 9
    grid = image_grid([a, b])
    assert grid.shape == (2, 8, 15)
    assert grid[:, :4].max() == 0 and grid[0, 4:].min() == 7
    assert grid[1, 4, 5] == 9  # row 2 (b), frame 1, pixel (0, 0), channel 1


def _synthetic_frames(n: int, rng: np.random.Generator) -> np.ndarray:
    """Frames with a bright 16x16 square at a random place on a dark background."""
    frames = np.full((n, 64, 64, 3), 20, np.uint8)
    for f in frames:
        y, x = rng.integers(0, 48, 2)
        f[y : y + 16, x : x + 16] = (230, 120, 40)
    return frames


def _store(directory, episodes=4, length=12, seed=0) -> EpisodeStore:
    rng = np.random.default_rng(seed)
    store = EpisodeStore(directory)
    for _ in range(episodes):
        is_first = np.zeros(length, bool)
        is_first[0] = True
        is_last = np.zeros(length, bool)
        is_last[-1] = True
        store.add(
            {
                "obs": _synthetic_frames(length, rng),
                "action": rng.integers(0, 2, length),
                "reward": np.ones(length, np.float32),
                "is_first": is_first,
                "is_last": is_last,
                "is_terminal": is_last.copy(),
            }
        )
    return store


def test_one_training_step_on_frames_without_a_trainer():
    """The fast lane's check: V builds, and one optimizer step on the loss of its training_step
    changes its weights."""
    torch.manual_seed(0)
    model = Vision(PIXELS, **VISION_TINY)
    model.log = model.log_dict = lambda *args, **kwargs: None  # training_step outside a Trainer
    optimizer = model.configure_optimizers()
    optimizer = optimizer["optimizer"] if isinstance(optimizer, dict) else optimizer
    before = {k: v.clone() for k, v in model.state_dict().items()}
    loss = model.training_step({"obs": torch.from_numpy(_synthetic_frames(4, np.random.default_rng(0)))}, 0)
    assert torch.isfinite(loss)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.slow
def test_tiny_fit_lowers_reconstruction_and_logs_image_grid(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from lightning_wm.data.offline import EpisodeDataModule

    _store(tmp_path / "frames", episodes=6, length=16)
    dm = EpisodeDataModule(
        str(tmp_path / "frames"), mode="frames", batch_size=16, val_fraction=0.3, train_batches=30, val_batches=1
    )
    model = Vision(PIXELS, latent_dim=8, depth=8, optim=OptimSettings(lr=2e-3))
    logger = TensorBoardLogger(str(tmp_path / "logs"), name="v")
    trainer = quiet_trainer(
        max_epochs=1,
        logger=logger,
        num_sanity_val_steps=0,
        log_every_n_steps=1,
    )
    obs = torch.from_numpy(_synthetic_frames(16, np.random.default_rng(5)))
    with torch.no_grad():
        before = model.losses({"obs": obs})["recon"].item()
    trainer.fit(model, datamodule=dm)
    with torch.no_grad():
        after = model.losses({"obs": obs})["recon"].item()
    assert after < 0.7 * before, (before, after)
    for key in ("val/recon", "val/kl", "val/mse", "val/loss"):
        assert key in trainer.callback_metrics
    events = EventAccumulator(logger.log_dir, size_guidance={"images": 0})
    events.Reload()
    assert "val/original_vs_reconstruction" in events.Tags()["images"]  # add_figure writes an image
    image = events.Images("val/original_vs_reconstruction")[-1]
    assert image.width > image.height > 0


def test_validation_without_logger_does_not_fail(tmp_path):
    model = Vision(PIXELS, **VISION_TINY)
    batch = {"obs": torch.randint(0, 256, (3, 64, 64, 3), dtype=torch.uint8)}
    with pytest.warns(UserWarning, match="self.log"):  # no trainer: Lightning only warns
        model.validation_step(batch, 0)
    losses = model.losses(batch)
    assert all(torch.isfinite(v) for v in losses.values())


def test_reconstruction_figure_has_labelled_rows_and_columns():
    model = Vision(PIXELS, **VISION_TINY, grid_frames=3)
    fig = model.reconstruction_figure(torch.randint(0, 256, (5, 64, 64, 3), dtype=torch.uint8))
    axes = fig.get_axes()
    assert len(axes) == 2 * 3
    assert [ax.get_ylabel() for ax in axes[::3]] == ["original", "reconstruction"]
    assert [ax.get_title() for ax in axes[:3]] == ["frame 0", "frame 1", "frame 2"]
    assert "reconstruction" in fig._suptitle.get_text()


def test_optimizer_and_settings_in_the_checkpoint():
    model = Vision(PIXELS, **VISION_TINY)
    opt = model.configure_optimizers()
    assert isinstance(opt, torch.optim.Adam) and opt.param_groups[0]["lr"] == 1e-4  # the reference's
    latent_dim = VISION_TINY["latent_dim"]
    assert model.hparams["optim"]["lr"] == 1e-4 and model.hparams["latent_dim"] == latent_dim  # plain dicts
    rebuilt = Vision(**{k: v for k, v in model.hparams.items()})
    assert rebuilt.optim == model.optim


def test_convert_episodes_writes_latents_and_keeps_the_rest(tmp_path):
    source = _store(tmp_path / "pixels", episodes=3, length=7)
    source.write_metadata({"env": {"id": "Synthetic"}})
    target = EpisodeStore(tmp_path / "latents")
    target.write_metadata({**source.read_metadata(), "source": "pixels"})
    model = Vision(PIXELS, latent_dim=6, depth=4)
    assert convert_episodes(model, source, target, batch_size=5) == 3
    assert model.training  # mode restored
    assert len(target.paths()) == 3
    for src_path, dst_path in zip(source.paths(), target.paths()):
        src, dst = source.load(src_path), target.load(dst_path)
        assert "obs" not in dst and dst["mu"].shape == dst["logvar"].shape == (7, 6)
        assert dst["mu"].dtype == np.float32
        for key in ("action", "reward", "is_first", "is_last", "is_terminal"):
            np.testing.assert_array_equal(dst[key], src[key])
        model.eval()
        with torch.no_grad():
            mu, logvar = model.encode(torch.from_numpy(src["obs"]))
        np.testing.assert_allclose(dst["mu"], mu.numpy(), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(dst["logvar"], logvar.numpy(), rtol=1e-5, atol=1e-5)
    meta = target.read_metadata()
    assert meta["env"] == {"id": "Synthetic"} and meta["latent"]["latent_dim"] == 6
    with pytest.raises(ValueError, match="already holds episodes"):
        convert_episodes(model, source, target)


def test_encode_frames_chunks_match_one_batch():
    model = Vision(PIXELS, **VISION_TINY).eval()
    obs = np.random.default_rng(0).integers(0, 256, (9, 64, 64, 3), dtype=np.uint8)
    mu_a, _ = encode_frames(model, obs, batch_size=4)
    mu_b, _ = encode_frames(model, obs, batch_size=100)
    torch.testing.assert_close(mu_a, mu_b)
