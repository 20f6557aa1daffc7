"""The image/GIF logger: TensorBoard images at the global step, GIFs beside the logs, rank zero only."""

from types import SimpleNamespace

import numpy as np
import pytorch_lightning as pl
import torch
from PIL import Image

from lightning_wm.logging import image_grid, log_gif, log_image


class _Experiment:
    def __init__(self):
        self.images = []

    def add_image(self, tag, image, step, dataformats):
        self.images.append((tag, tuple(image.shape), step, dataformats))


def _module(tmp_path, zero=True):
    module = pl.LightningModule()
    logger = SimpleNamespace(experiment=_Experiment(), log_dir=str(tmp_path))
    module._trainer = SimpleNamespace(is_global_zero=zero, logger=logger, global_step=7)
    return module, logger


def test_image_and_gif_go_to_the_run_at_the_global_step(tmp_path):
    module, logger = _module(tmp_path)
    grid = image_grid([torch.zeros(3, 4, 5, 1, dtype=torch.uint8), torch.ones(3, 4, 5, 1, dtype=torch.uint8)])
    assert log_image(module, "val/grid", grid)
    assert logger.experiment.images == [("val/grid", (1, 8, 15), 7, "CHW")]
    frames = torch.arange(4, dtype=torch.uint8).mul(60).view(4, 1, 1, 1).expand(4, 6, 10, 3).clone()
    frames[2, :, :5] = 255
    path = log_gif(module, "openloop", frames)
    assert path == str(tmp_path / "openloop" / "step_7.gif")
    with Image.open(path) as gif:
        assert gif.n_frames == 4 and gif.size == (10, 6)
        gif.seek(2)
        assert np.asarray(gif.convert("RGB"))[0, 0].tolist() == [255, 255, 255]


def test_nothing_is_logged_without_a_trainer_or_off_rank_zero(tmp_path):
    assert not log_image(pl.LightningModule(), "x", torch.zeros(1, 2, 2))
    assert log_gif(pl.LightningModule(), "x", torch.zeros(2, 2, 2, 3, dtype=torch.uint8)) is None
    module, logger = _module(tmp_path, zero=False)
    assert not log_image(module, "x", torch.zeros(1, 2, 2)) and logger.experiment.images == []
    assert log_gif(module, "x", torch.zeros(2, 2, 2, 3, dtype=torch.uint8)) is None
    assert not list(tmp_path.iterdir())
