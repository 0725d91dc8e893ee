"""Long-horizon drift: a token world model rolled out on its own predictions.

From K true context frames, the model predicts F frames with the true actions, then
predicts the next F from the last K frames it has (its own predictions, once the true
context is used up), until H frames exist. The per-step scores t = 1..H and their slope
show how fast the error grows; copying the last context frame (through the tokenizer)
for all H steps is the reference that "nothing moves" gives.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from transformers import PreTrainedModel

from mmrl.errors import DataError
from mmrl.tasks.worldmodel_eval import (
    _nanmean,
    frame_scores,
    generate,
    step_slopes,
    through_tokenizer,
)
from mmrl.verifiers.repetition import DEFAULT_TAU
from mmrl.worldmodel.token_lm import TokenWorldModelProcessor
from mmrl.worldmodel.tokenizer import VQTokenizer
from mmrl.worldmodel.windows import FrameWindows, load_windows, longest_trajectory


def rollout_frames(
    model: PreTrainedModel,
    processor: TokenWorldModelProcessor,
    tokenizer: VQTokenizer,
    windows: FrameWindows,
    horizon: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Greedy predictions ``uint8 [N, horizon, H, W, 3]`` and ``valid [N]`` (every step
    decoded). ``windows`` hold K context frames and the K + horizon - 1 actions."""
    from mmrl.processors.worldmodel import WorldModelPromptProcessor

    k, f = processor.context, processor.future
    prompts = WorldModelPromptProcessor(processor, tokenizer)
    frames, actions = windows.context, windows.actions
    n = len(frames)
    valid = np.ones(n, bool)
    done = 0
    while done < horizon:
        need = actions[:, done : done + k + f - 1]
        if need.shape[1] < k + f - 1:  # the last step predicts past the horizon: pad
            pad = np.repeat(need[:, -1:], k + f - 1 - need.shape[1], axis=1)
            need = np.concatenate([need, pad], axis=1)
        step = FrameWindows(frames[:, -k:], need, np.zeros((n, f, *frames.shape[2:]), np.uint8))
        responses = generate(
            model,
            prompts.encode_windows(step),
            processor,
            greedy=True,
            forced=prompts.forced_ids(step),
        )
        out, ok, _ = processor.decode_frames(responses.tolist(), tokenizer)
        take = min(f, horizon - done)
        frames = np.concatenate([frames, out[:, :take]], axis=1)
        valid &= ok
        done += take
    return frames[:, k:], valid


def check_rollout_length(source: Any, context: int, horizon: int) -> None:
    """Raise unless some trajectory holds ``context + horizon`` frames (before any work)."""
    longest = longest_trajectory(source)
    if longest < context + horizon:
        raise DataError(
            f"a rollout of {horizon} frames after {context} context frames needs trajectories "
            f"of {context + horizon} frames; the longest has {longest}: lower --horizon or use "
            "longer episodes"
        )


def evaluate_rollout(
    model: PreTrainedModel,
    processor: TokenWorldModelProcessor,
    tokenizer: VQTokenizer,
    source: Any,
    horizon: int = 12,
    n: int | None = 64,
    seed: int = 0,
    tau: float = DEFAULT_TAU,
) -> dict[str, dict[str, float]]:
    """Per-step metrics (``psnr@t1`` .. ``@tH``, slopes, repetition) of an H-frame rollout on
    ``n`` windows of ``source`` (each needs K + H frames), beside copying the last frame."""
    k = processor.context
    check_rollout_length(source, k, horizon)
    windows = load_windows(source, k, horizon, n, seed)
    pred, valid = rollout_frames(model, processor, tokenizer, windows, horizon)
    last = windows.context[:, -1]
    decoded = through_tokenizer(tokenizer, last)  # both rows in token space, as in mmrl eval
    copy = np.repeat(decoded[:, None], horizon, axis=1)
    rows = {}
    for name, frames, ok in (
        ("model (greedy rollout)", pred, valid),
        ("copy last context frame", copy, np.ones(len(copy), bool)),
    ):
        scores = frame_scores(frames, windows.future, ok, windows.env, last, tau, decoded)
        rows[name] = {key: _nanmean(v) for key, v in scores.items()}
        rows[name].update(step_slopes(rows[name], horizon))
    return rows
