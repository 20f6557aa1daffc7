"""Write rendered frames to a GIF (Pillow) or an MP4 (ffmpeg from ``imageio-ffmpeg``).

TensorBoard's ``add_video`` needs moviepy 1 and writes nothing with moviepy 2, so videos are
written as files beside the logs instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from lightning_wm.io import check_writable

VIDEO_SUFFIXES = (".gif", ".mp4")
_MP4_HINT = "writing .mp4 needs imageio-ffmpeg: pip install 'lightning-wm[video]' (or ask for a .gif)"


def check_video_path(path: str) -> None:
    """Fail before any work is done if ``path`` is not a video this module can write (suffix,
    encoder, a folder that can be written)."""
    suffix = Path(path).suffix.lower()
    if suffix not in VIDEO_SUFFIXES:
        raise ValueError(f"video path {path!r}: the file name must end in .gif or .mp4")
    if suffix == ".mp4":
        try:
            import imageio_ffmpeg  # noqa: F401
        except ImportError as err:
            raise ValueError(_MP4_HINT) from err
    check_writable(Path(path).parent, "video folder")


def write_gif(frames: Sequence[np.ndarray], path: str, fps: int = 30) -> None:
    """``frames``: ``[H, W, 3]`` (or ``[H, W]``) uint8 arrays; an animated GIF that loops."""
    from PIL import Image

    images = [Image.fromarray(np.asarray(f)) for f in frames]
    images[0].save(path, save_all=True, append_images=images[1:], duration=int(1000 / fps), loop=0)


def write_mp4(frames: Sequence[np.ndarray], path: str, fps: int = 30) -> None:
    """``frames``: ``[H, W, 3]`` uint8 arrays; H.264 in yuv420p (plays in browsers and players).
    Odd sizes are padded to even ones with black, which yuv420p needs."""
    try:
        import imageio_ffmpeg
    except ImportError as err:
        raise ValueError(_MP4_HINT) from err
    first = np.asarray(frames[0])
    h, w = first.shape[:2]
    ph, pw = h + h % 2, w + w % 2
    writer = imageio_ffmpeg.write_frames(
        path,
        (pw, ph),
        fps=fps,
        codec="libx264",
        pix_fmt_in="rgb24",
        pix_fmt_out="yuv420p",
        macro_block_size=1,
        quality=7,
    )
    writer.send(None)  # start ffmpeg
    try:
        for frame in frames:
            frame = np.asarray(frame, dtype=np.uint8)
            if frame.ndim == 2:
                frame = np.repeat(frame[..., None], 3, -1)
            padded = np.zeros((ph, pw, 3), np.uint8)
            padded[:h, :w] = frame[..., :3]
            writer.send(np.ascontiguousarray(padded))
    finally:
        writer.close()


def write_video(frames: Sequence[np.ndarray], path: str, fps: int = 30) -> None:
    """GIF or MP4 by the suffix of ``path``."""
    check_video_path(path)
    if not frames:
        raise ValueError(f"no frames to write to {path}")
    (write_mp4 if Path(path).suffix.lower() == ".mp4" else write_gif)(frames, path, fps)
