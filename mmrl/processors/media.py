"""Media for VLM prompts: images and videos from the forms datasets hold them in.

Images: PIL images, encoded bytes (PNG/JPEG), paths, or ``{"bytes", "path"}`` dicts
(the parquet struct). Videos: mp4 paths or bytes (read with decord), or uint8 frames
[F, H, W, 3] already sampled.
"""

from __future__ import annotations

import hashlib
import io
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image
from transformers.video_utils import VideoMetadata

ImageInput = Image.Image | bytes | str | Path | Mapping[str, Any]
VideoInput = str | Path | bytes | np.ndarray


def load_image(image: ImageInput) -> Image.Image:
    """An RGB PIL image from a PIL image, encoded bytes, a path or a ``{bytes, path}`` dict."""
    if isinstance(image, Mapping):
        image = image.get("bytes") or image.get("path")
        if image is None:
            raise ValueError("image struct has neither 'bytes' nor 'path'")
    if isinstance(image, bytes):
        image = Image.open(io.BytesIO(image))
    elif isinstance(image, str | Path):
        image = Image.open(image)
    if not isinstance(image, Image.Image):
        raise TypeError(
            f"expected a PIL image, bytes, a path or a {{bytes, path}} dict, found "
            f"{type(image).__name__}"
        )
    return image.convert("RGB")


def read_video(
    video: VideoInput, fps: float, min_frames: int, max_frames: int, frame_multiple: int = 2
) -> tuple[np.ndarray, VideoMetadata]:
    """Frames uint8 [F, H, W, 3] sampled uniformly at ``fps`` (F clamped to the frame limits).

    F is rounded down to a multiple of ``frame_multiple`` (the temporal patch size) when the
    video has enough frames. Arrays are taken as already sampled (fps = ``fps``).
    """
    if isinstance(video, np.ndarray):
        if video.ndim != 4 or video.shape[-1] != 3:
            raise ValueError(
                f"video frames must be uint8 [F, H, W, 3], found {video.dtype} {list(video.shape)}"
            )
        n = len(video)
        return video, VideoMetadata(total_num_frames=n, fps=fps, frames_indices=list(range(n)))
    import decord

    source = io.BytesIO(video) if isinstance(video, bytes) else str(video)
    reader = decord.VideoReader(source, num_threads=1)
    total, src_fps = len(reader), float(reader.get_avg_fps())
    n = min(max(round(total / src_fps * fps), min_frames), max_frames, total)
    if n >= frame_multiple:
        n -= n % frame_multiple
    indices = np.linspace(0, total - 1, n).round().astype(int).tolist()
    frames = reader.get_batch(indices).asnumpy()
    meta = VideoMetadata(
        total_num_frames=total, fps=src_fps, frames_indices=indices, duration=total / src_fps
    )
    return frames, meta


def media_digest(prompt: str, media: Sequence[ImageInput | VideoInput]) -> str:
    """A digest of the prompt and media content (files by path, size and mtime)."""
    h = hashlib.blake2b(prompt.encode(), digest_size=16)
    for item in media:
        if isinstance(item, Mapping):
            item = item.get("bytes") or item.get("path")
        if isinstance(item, bytes):
            h.update(item)
        elif isinstance(item, str | Path):
            stat = os.stat(item)
            h.update(f"{os.fspath(item)}:{stat.st_size}:{stat.st_mtime_ns}".encode())
        elif isinstance(item, Image.Image):
            h.update(f"{item.mode}{item.size}".encode() + item.tobytes())
        elif isinstance(item, np.ndarray):
            h.update(f"{item.dtype}{item.shape}".encode() + np.ascontiguousarray(item).tobytes())
        else:
            raise TypeError(
                f"cannot hash media of type {type(item).__name__}; give the sample a key"
            )
        h.update(b"|")
    return h.hexdigest()
