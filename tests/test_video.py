"""Video files: GIF frames and MP4 container, odd sizes, bad paths."""

import numpy as np
import pytest
from PIL import Image

from lightning_wm.video import check_video_path, write_video


def frames(n: int = 6, h: int = 33, w: int = 50) -> list[np.ndarray]:
    out = []
    for t in range(n):
        f = np.zeros((h, w, 3), np.uint8)
        f[:, : (t + 1) * w // n] = (255, 40, 40)
        out.append(f)
    return out


def test_gif_has_every_frame(tmp_path):
    path = str(tmp_path / "a.gif")
    write_video(frames(), path, fps=10)
    with Image.open(path) as image:
        assert image.n_frames == 6 and image.size == (50, 33)
        image.seek(5)
        assert np.asarray(image.convert("RGB"))[0, -1, 0] > 200  # the last frame is all red


def test_mp4_of_an_odd_sized_frame(tmp_path):
    import imageio_ffmpeg

    path = str(tmp_path / "a.mp4")
    write_video(frames(), path, fps=10)
    reader = imageio_ffmpeg.read_frames(path)
    meta = reader.__next__()
    decoded = list(reader)
    assert tuple(meta["size"]) == (50, 34)  # padded to even for yuv420p
    assert len(decoded) == 6


@pytest.mark.parametrize("path", ["a.avi", "a", "a.gif.txt"])
def test_unknown_suffix_is_refused(path):
    with pytest.raises(ValueError, match="must end in .gif or .mp4"):
        check_video_path(path)


def test_no_frames_is_refused(tmp_path):
    with pytest.raises(ValueError, match="no frames"):
        write_video([], str(tmp_path / "a.gif"))
