"""A few validation samples per validation, for the run report: ``samples.jsonl`` plus
thumbnails under ``samples/`` in the run folder.

Each line of ``samples.jsonl`` is one sample: ``step`` (0 is before training), ``index`` (its
place in the validation batch), ``prompt``, ``response``, ``ground_truth``, ``score``,
``valid`` and ``images`` (paths relative to the run folder). Images are the prompt's own (a
VLM's input images, from the validation dataset's ``images``) or, for world models, one strip
per sample: last context frame | true future | predicted future.
"""

from __future__ import annotations

import io
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from mmrl.protocol import Batch

SAMPLES_FILE = "samples.jsonl"
SAMPLES_DIR = "samples"
THUMBNAIL_PX = 160  # longest side of a saved thumbnail
MAX_TEXT_CHARS = 2000  # a prompt or response is cut here in the log


class SampleLog:
    """Appends ``per_validation`` samples of each validation to ``<run_dir>/samples.jsonl``.

    ``val_images``: the validation dataset's images per prompt (``dataset.images``, a list of
    lists of PIL images, encoded bytes or paths) or None. They line up with the validation
    batch only when no prompt was filtered out, which the caller checks.
    """

    def __init__(
        self, run_dir: Path, per_validation: int = 8, val_images: Sequence[Any] | None = None
    ) -> None:
        self.run_dir, self.per_validation, self.val_images = (
            Path(run_dir),
            per_validation,
            val_images,
        )
        self.path = self.run_dir / SAMPLES_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text("")

    def record(self, step: int, batch: Batch, repeats: int) -> None:
        """Log the first samples of a scored validation batch (``token_level_scores``,
        ``valid_mask``); row ``i`` answers prompt ``i // repeats``."""
        scores = batch["token_level_scores"].sum(-1).tolist()
        valid = batch["valid_mask"].bool().tolist()
        rows = []
        for i in range(min(self.per_validation, len(batch))):
            rows.append(
                {
                    "step": step,
                    "index": i,
                    "prompt": _text(batch, "raw_prompt", i),
                    "response": _text(batch, "response_text", i),
                    "ground_truth": _text(batch, "ground_truth", i),
                    "score": float(scores[i]),
                    "valid": bool(valid[i]),
                    "images": self._save_images(step, i, batch, i // repeats),
                }
            )
        with self.path.open("a") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)

    def _save_images(self, step: int, row: int, batch: Batch, prompt: int) -> list[str]:
        images = []
        if "pred_frames" in batch and "gt_frames" in batch:
            images.append(frame_strip(batch, row))
        elif self.val_images is not None and prompt < len(self.val_images):
            images.extend(_open_image(im) for im in self.val_images[prompt])
        paths = []
        for j, image in enumerate(images):
            rel = f"{SAMPLES_DIR}/step{step}_{row}_{j}.png"
            (self.run_dir / SAMPLES_DIR).mkdir(exist_ok=True)
            thumb = image.convert("RGB")
            thumb.thumbnail((THUMBNAIL_PX, THUMBNAIL_PX))
            thumb.save(self.run_dir / rel)
            paths.append(rel)
        return paths


def frame_strip(batch: Batch, row: int) -> Image.Image:
    """Row ``row``'s last context frame (when the batch has it) | true future | predicted
    future, side by side with 2 px gaps; undecodable predictions (NaN) show black."""
    parts = []
    if "last_context_frame" in batch:
        parts.append(_unit_uint8(batch["last_context_frame"][row]))
    for key in ("gt_frames", "pred_frames"):
        frames = batch[key][row]
        frames = frames if frames.ndim == 4 else frames[None]
        parts.extend(_unit_uint8(f) for f in frames)
    height = parts[0].shape[0]
    gap = np.full((height, 2, 3), 255, np.uint8)
    strip = [p for part in parts for p in (part, gap)][:-1]
    return Image.fromarray(np.concatenate(strip, axis=1))


def _unit_uint8(frame: torch.Tensor) -> np.ndarray:
    """A frame [H, W, 3] (uint8, or float in [0, 1] with NaN) as uint8 [H, W, 3]."""
    if frame.dtype == torch.uint8:
        return frame.cpu().numpy()
    values = torch.nan_to_num(frame.float(), nan=0.0).clamp(0, 1)
    return (values * 255).round().to(torch.uint8).cpu().numpy()


def _open_image(image: Any) -> Image.Image:
    if isinstance(image, Image.Image):
        return image
    if isinstance(image, dict):  # the parquet struct {"bytes", "path"}
        image = image.get("bytes") or image.get("path")
    if isinstance(image, bytes | bytearray):
        return Image.open(io.BytesIO(image))
    return Image.open(image)


def _text(batch: Batch, key: str, row: int) -> str | None:
    if key not in batch.non_tensor:
        return None
    value = batch.non_tensor[key][row]
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text[:MAX_TEXT_CHARS]


def read_samples(run_dir: Path) -> list[dict[str, Any]]:
    """The samples a run logged (``[]`` when it logged none); a torn last line (a run killed
    while writing) is skipped."""
    return read_jsonl(Path(run_dir) / SAMPLES_FILE)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of a JSONL file, ``[]`` when it is absent; lines that do not parse (a
    torn last line) are skipped."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows
