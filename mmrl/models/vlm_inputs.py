"""The batch layout of VLM inputs: visual-input collation, mrope position ids, token checks.

Per sample, ``multi_modal_inputs`` is a dict of tensors (only the keys it needs):

- ``pixel_values`` [N, D]: the patches of all its images, N = sum of t*h*w over them;
- ``image_grid_thw`` [n_images, 3]: (t, h, w) patches per image;
- ``pixel_values_videos`` [M, D] and ``video_grid_thw`` [n_videos, 3]: the same for videos;
- ``second_per_grid_ts`` [n_videos] (Qwen2.5-VL only): seconds per temporal patch.

A batch concatenates these along the patch dimension (dim 0) and keeps one grid row per
image/video, so every sample's patches stay contiguous and in order; the model splits
them back with the grids. ``position_ids`` of mrope models are [B, 3, L]: the model's own
three rows (temporal, height, width), batch dim first like every other Batch tensor.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

IMAGE_KEYS = ("pixel_values", "image_grid_thw")
VIDEO_KEYS = ("pixel_values_videos", "video_grid_thw", "second_per_grid_ts")
# What the model's forward takes; second_per_grid_ts only shapes position ids, computed earlier.
MODEL_VISUAL_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")
COUNT_KEYS = ("num_images", "num_videos")


class VisionTokenMismatchError(ValueError):
    """The vision placeholder tokens of a prompt and its visual features disagree."""


def collate_multi_modal(
    inputs: Sequence[Mapping[str, torch.Tensor] | None],
) -> dict[str, torch.Tensor]:
    """Concatenate per-sample visual inputs along the patch dimension.

    Args:
        inputs: B dicts in the layout of the module docstring; text-only samples may
            be empty or None.

    Returns:
        Each key present in any sample, concatenated along dim 0 in sample order
        (``pixel_values`` [sum N, D], ``image_grid_thw`` [sum n_images, 3], ...), plus
        ``num_images`` and ``num_videos`` [B] (long) that :func:`split_multi_modal` uses.
    """
    rows = [dict(x or {}) for x in inputs]
    for i, row in enumerate(rows):
        for pixels, grid in (
            ("pixel_values", "image_grid_thw"),
            ("pixel_values_videos", "video_grid_thw"),
        ):
            if (pixels in row) != (grid in row):
                raise KeyError(
                    f"sample {i}: multi_modal_inputs has {sorted(row)}; {pixels} and {grid} "
                    "must come together (the grid says how many patches each image/video has)"
                )
    out: dict[str, torch.Tensor] = {}
    for key in IMAGE_KEYS + VIDEO_KEYS:
        parts = [row[key] for row in rows if key in row]
        if parts:
            out[key] = torch.cat([torch.as_tensor(p) for p in parts], dim=0)
    out["num_images"] = torch.tensor(
        [len(row.get("image_grid_thw", ())) for row in rows], dtype=torch.long
    )
    out["num_videos"] = torch.tensor(
        [len(row.get("video_grid_thw", ())) for row in rows], dtype=torch.long
    )
    return out


def split_multi_modal(collated: Mapping[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """The inverse of :func:`collate_multi_modal`: one dict per sample (empty for text-only)."""
    rows: list[dict[str, torch.Tensor]] = [{} for _ in range(len(collated["num_images"]))]
    for pixels, grid, count, extra in (
        ("pixel_values", "image_grid_thw", "num_images", None),
        ("pixel_values_videos", "video_grid_thw", "num_videos", "second_per_grid_ts"),
    ):
        counts = collated[count].tolist()
        if grid not in collated:
            if any(counts):
                raise KeyError(f"{count} is {counts} but there is no {grid} to split")
            continue
        grids = torch.split(collated[grid], counts)
        patches = torch.split(collated[pixels], [int(g.prod(-1).sum()) for g in grids])
        extras = torch.split(collated[extra], counts) if extra in collated else [None] * len(rows)
        for row, n, g, p, e in zip(rows, counts, grids, patches, extras, strict=True):
            if n:
                row.update({pixels: p, grid: g})
                if e is not None:
                    row[extra] = e
    return rows


def mm_token_type_ids(
    input_ids: torch.Tensor, image_token_id: int, video_token_id: int
) -> torch.Tensor:
    """Token types [B, L] as the Qwen-VL processors write them: text 0, image 1, video 2."""
    return (input_ids == image_token_id).long() + 2 * (input_ids == video_token_id).long()


def check_vision_tokens(
    input_ids: torch.Tensor,
    multi_modal_inputs: Sequence[Mapping[str, torch.Tensor] | None],
    image_token_id: int,
    video_token_id: int,
    merge_size: int,
    sample_ids: Sequence[int] | None = None,
) -> None:
    """Raise :class:`VisionTokenMismatchError` where tokens and features disagree.

    For each sample the number of ``image_token_id`` tokens in ``input_ids`` [B, L]
    must equal sum(t*h*w) / merge_size**2 over its ``image_grid_thw`` (likewise for
    videos), and ``pixel_values`` must have sum(t*h*w) rows. This is the model's
    "Image features and image tokens do not match", raised before the model call with
    the sample and a likely cause.
    """
    sample_ids = list(range(len(input_ids))) if sample_ids is None else list(sample_ids)
    for row, (ids, mm) in enumerate(zip(input_ids, multi_modal_inputs, strict=True)):
        mm = mm or {}
        for kind, token_id, pixels, grid in (
            ("image", image_token_id, "pixel_values", "image_grid_thw"),
            ("video", video_token_id, "pixel_values_videos", "video_grid_thw"),
        ):
            n_tokens = int((ids == token_id).sum())
            grids = mm.get(grid)
            n_patches = int(grids.prod(-1).sum()) if grids is not None else 0
            n_features = n_patches // merge_size**2
            where = f"sample {sample_ids[row]}"
            if n_tokens != n_features:
                n_items = 0 if grids is None else len(grids)
                raise VisionTokenMismatchError(
                    f"{where}: {n_tokens} {kind} tokens in input_ids but {n_features} {kind} "
                    "features "
                    f"(sum of t*h*w / {merge_size}**2 over {n_items} {kind}_grid_thw rows). "
                    f"Likely cause: {_mismatch_cause(kind, n_tokens, n_features)}"
                )
            if grids is not None and mm[pixels].shape[0] != n_patches:
                raise VisionTokenMismatchError(
                    f"{where}: {pixels} has {mm[pixels].shape[0]} rows but {grid} implies "
                    f"{n_patches} "
                    "patches. Likely cause: pixel values and grids collated from different "
                    "samples, or split back with the wrong counts"
                )


def _mismatch_cause(kind: str, n_tokens: int, n_features: int) -> str:
    if n_features == 0:
        return (
            f"the prompt has {kind} placeholders but its {kind}s are missing (dropped or "
            "filtered after tokenization, or a raw prompt with expanded tokens was re-encoded)"
        )
    if n_tokens == 0:
        return (
            f"the prompt has no {kind} placeholder: the chat template did not insert one per {kind}"
        )
    if n_tokens < n_features:
        return (
            "the prompt was truncated through its vision tokens, or has fewer placeholders than "
            f"{kind}s"
        )
    return (
        f"the prompt text already held expanded {kind} tokens and was processed twice, or "
        f"{kind}s were resized after tokenization (min_pixels/max_pixels changed)"
    )


def extend_position_ids(position_ids: torch.Tensor, response_length: int) -> torch.Tensor:
    """Append positions for ``response_length`` generated tokens.

    Args:
        position_ids: prompt positions, [B, P] (1-D rope) or [B, 3, P] (mrope). Left
            padding holds position 0.

    Returns:
        [B, P + T] or [B, 3, P + T]. Response token k sits at ``start + k`` in every row,
        where ``start`` is the largest prompt position + 1 (for 1-D rope, the last position
        + 1). This is what the Qwen-VL models use while decoding: text positions after the
        prompt's ``rope_deltas``.
    """
    steps = torch.arange(response_length, device=position_ids.device)
    if position_ids.ndim == 2:
        return torch.cat([position_ids, position_ids[:, -1:] + 1 + steps], dim=1)
    if position_ids.ndim != 3:
        raise ValueError(
            f"position_ids must be [B, P] or [B, 3, P], found {list(position_ids.shape)}"
        )
    start = position_ids.amax(dim=(1, 2)) + 1  # [B]
    response = (start[:, None] + steps).unsqueeze(1).expand(-1, position_ids.shape[1], -1)
    return torch.cat([position_ids, response], dim=2)
