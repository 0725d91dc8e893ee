"""Media for VLM prompts: images and videos from the forms datasets hold them in.

Images: PIL images, encoded bytes (PNG/JPEG), paths, or ``{"bytes", "path"}`` dicts
(the parquet struct). Videos: mp4 paths or bytes (read with decord), or uint8 frames
[F, H, W, 3] already sampled.

Media may come from anyone's dataset, so its size is checked before it is decoded in
full: encoded bytes and pixel count from the image header (``data.max_image_bytes``,
``data.max_image_pixels``), frame count from the video container
(``data.max_video_frames``). A file that cannot be decoded is a :class:`MediaReadError`.
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

from mmrl.errors import DataError

ImageInput = Image.Image | bytes | str | Path | Mapping[str, Any]
VideoInput = str | Path | bytes | np.ndarray


class MediaError(DataError):
    """An image or video of a dataset cannot be used (a DataError: printed in one line)."""


class MediaTooLargeError(MediaError):
    """An image or video is over a ``data.max_image_*`` / ``data.max_video_frames`` limit."""


class MediaReadError(MediaError):
    """An image or video file is damaged or not in a format that can be decoded."""


def _describe(item: Any) -> str:
    return f"{len(item)} bytes" if isinstance(item, bytes) else f"file {os.fspath(item)}"


def _check_bytes(item: bytes | str | Path, max_bytes: int | None) -> None:
    if max_bytes is None:
        return
    size = len(item) if isinstance(item, bytes) else os.path.getsize(item)
    if size > max_bytes:
        raise MediaTooLargeError(
            f"image ({_describe(item)}) has {size} encoded bytes, over "
            f"data.max_image_bytes={max_bytes}; shrink the image or raise the limit"
        )


def load_image(
    image: ImageInput, max_bytes: int | None = None, max_pixels: int | None = None
) -> Image.Image:
    """An RGB PIL image from a PIL image, encoded bytes, a path or a ``{bytes, path}`` dict.

    Encoded images over ``max_bytes`` or ``max_pixels`` (width * height, read from the
    header) raise :class:`MediaTooLargeError` before they are decoded; undecodable ones
    raise :class:`MediaReadError`.
    """
    if isinstance(image, Mapping):
        image = image.get("bytes") or image.get("path")
        if image is None:
            raise ValueError("image struct has neither 'bytes' nor 'path'")
    source = image
    if isinstance(image, bytes | str | Path):
        _check_bytes(image, max_bytes)
        try:  # open() reads the header only; pixels are decoded by convert() below
            image = Image.open(io.BytesIO(image) if isinstance(image, bytes) else image)
        except Image.DecompressionBombError as err:
            raise MediaTooLargeError(f"image ({_describe(source)}): {err}") from err
        except (OSError, SyntaxError, ValueError) as err:
            if isinstance(err, FileNotFoundError):
                raise
            raise MediaReadError(
                f"image ({_describe(source)}) cannot be decoded, it is damaged or not an "
                f"image: {type(err).__name__}: {err}"
            ) from err
    if not isinstance(image, Image.Image):
        raise TypeError(
            f"expected a PIL image, bytes, a path or a {{bytes, path}} dict, found "
            f"{type(image).__name__}"
        )
    width, height = image.size
    if max_pixels is not None and width * height > max_pixels:
        raise MediaTooLargeError(
            f"image ({_describe(source) if source is not image else 'PIL'}) is {width}x{height} "
            f"= {width * height} pixels, over data.max_image_pixels={max_pixels}; shrink the "
            "image or raise the limit"
        )
    try:
        return image.convert("RGB")
    except (OSError, SyntaxError, ValueError) as err:  # a truncated or corrupt pixel stream
        raise MediaReadError(
            f"image ({_describe(source) if source is not image else 'PIL'}) cannot be decoded, "
            f"it is damaged: {type(err).__name__}: {err}"
        ) from err


def read_video(
    video: VideoInput,
    fps: float,
    min_frames: int,
    max_frames: int,
    frame_multiple: int = 2,
    max_video_frames: int | None = None,
) -> tuple[np.ndarray, VideoMetadata]:
    """Frames uint8 [F, H, W, 3] sampled uniformly at ``fps`` (F clamped to the frame limits).

    F is rounded down to a multiple of ``frame_multiple`` (the temporal patch size) when the
    video has enough frames. Arrays are taken as already sampled (fps = ``fps``). A video
    whose container holds more than ``max_video_frames`` frames raises
    :class:`MediaTooLargeError` before any frame is decoded; a damaged one
    :class:`MediaReadError`.
    """
    if isinstance(video, np.ndarray):
        if video.ndim != 4 or video.shape[-1] != 3:
            raise ValueError(
                f"video frames must be uint8 [F, H, W, 3], found {video.dtype} {list(video.shape)}"
            )
        n = len(video)
        return video, VideoMetadata(total_num_frames=n, fps=fps, frames_indices=list(range(n)))
    import decord

    if isinstance(video, str | Path) and not Path(video).is_file():
        raise FileNotFoundError(f"video file {video} does not exist")
    source = io.BytesIO(video) if isinstance(video, bytes) else str(video)
    try:
        reader = decord.VideoReader(source, num_threads=1)
        total, src_fps = len(reader), float(reader.get_avg_fps())
    except (decord.DECORDError, RuntimeError, ValueError) as err:
        raise MediaReadError(
            f"video ({_describe(video)}) cannot be decoded, it is damaged or not a video "
            f"decord can read: {type(err).__name__}: {str(err)[:200]}"
        ) from err
    if max_video_frames is not None and total > max_video_frames:
        raise MediaTooLargeError(
            f"video ({_describe(video)}) has {total} frames, over "
            f"data.max_video_frames={max_video_frames}; cut the video or raise the limit"
        )
    if total < 1 or not src_fps > 0:
        raise MediaReadError(
            f"video ({_describe(video)}) has {total} frames at {src_fps} fps; it is damaged "
            "or empty"
        )
    n = min(max(round(total / src_fps * fps), min_frames), max_frames, total)
    if n >= frame_multiple:
        n -= n % frame_multiple
    indices = np.linspace(0, total - 1, n).round().astype(int).tolist()
    try:
        frames = reader.get_batch(indices).asnumpy()
    except (decord.DECORDError, RuntimeError, ValueError) as err:
        raise MediaReadError(
            f"video ({_describe(video)}): frames {indices} cannot be decoded, the file is "
            f"damaged: {type(err).__name__}: {str(err)[:200]}"
        ) from err
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
