"""World-model prompts: K context frames + actions in, F predicted frames' tokens out.

:class:`~mmrl.worldmodel.windows.FrameWindows` is a task's dataset (arrays of context
frames, actions and true futures). :class:`WorldModelPromptProcessor` turns it into
fixed-length token prompts (see :mod:`mmrl.worldmodel.token_lm` for the sequence layout) and decodes
sampled responses back into frames with the VQ tokenizer, for the frame verifiers:

- ``pred_frames`` float32 [B, F, H, W, 3] in [0, 1]; NaN for a response that cannot be
  decoded, which the verifier runner turns into an invalid sample (not a crash);
- ``gt_frames`` uint8 [B, F, H, W, 3], the true future, set by :meth:`encode_dataset`;
- ``forced_response_ids`` int64 [B, T] (interleaved form only): the known actions the rollout
  engines write between predicted frames, -1 where they sample;
- ``frame_end_steps`` int64 [B, F]: each predicted frame's last response step, where a
  per-frame verifier score lands as a token-level reward;
- ``ground_truth`` (non-tensor): the environment's observed state of each true future
  frame, and ``env``: the environment's name and config, for the closed-loop
  ``state_match`` score (only when the data comes from a known environment).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from mmrl.protocol import Batch
from mmrl.sampling import FORCED_KEY, FRAME_END_KEY
from mmrl.worldmodel.token_lm import TokenWorldModelProcessor
from mmrl.worldmodel.tokenizer import VQTokenizer
from mmrl.worldmodel.windows import FrameWindows, load_windows

__all__ = ["FrameWindows", "WorldModelPromptProcessor", "load_windows"]


class WorldModelPromptProcessor:
    """The fit loop's :class:`~mmrl.processors.base.PromptProcessor` for the token world model."""

    def __init__(
        self,
        tokens: TokenWorldModelProcessor,
        tokenizer: VQTokenizer,
        max_prompt_length: int | None = None,
    ) -> None:
        tokens.check_tokenizer(tokenizer)
        if max_prompt_length is not None and tokens.prompt_length > max_prompt_length:
            raise ValueError(
                f"world-model prompts have {tokens.prompt_length} tokens ({tokens.context} frames "
                "of "
                f"{tokens.layout.tokens_per_frame} + actions), more than data.max_prompt_length="
                f"{max_prompt_length}"
            )
        self.tokens, self.tokenizer = tokens, tokenizer

    @property
    def pad_token_id(self) -> int:
        from mmrl.worldmodel.vocab import PAD

        return PAD

    @property
    def response_length(self) -> int:
        return self.tokens.response_length

    def encode_windows(self, windows: FrameWindows) -> torch.Tensor:
        """Prompt ids ``int64 [N, prompt_length]`` (every prompt has the same length)."""
        k, (h, w) = self.tokens.context, self.tokenizer.frame_shape
        frames = windows.context
        if frames.ndim != 5 or frames.shape[1] != k or frames.shape[2:] != (h, w, 3):
            raise ValueError(
                f"context frames must be uint8 [N, {k}, {h}, {w}, 3] for this model, found "
                f"{list(frames.shape)} (from "
                f"{windows.sources[0] if len(windows) else 'no windows'})"
            )
        codes = self.tokenizer.encode(frames.reshape(-1, h, w, 3)).reshape(
            len(frames), k, *self.tokenizer.grid
        )
        return torch.tensor(
            [self.tokens.build_prompt(c, a) for c, a in zip(codes, windows.actions, strict=True)],
            dtype=torch.long,
        )

    def forced_ids(self, windows: FrameWindows) -> torch.Tensor | None:
        """``int64 [N, response_length]``: the interleaved actions the engines write into each
        response (-1 where they sample); None in the prompt form (nothing is forced)."""
        if not self.tokens.interleaved:
            return None
        return torch.from_numpy(np.stack([self.tokens.forced_response(a) for a in windows.actions]))

    def encode_dataset(self, dataset: FrameWindows, split: str) -> Batch:
        """Prompts ``[N, P]`` (no padding needed: all have one length) plus ``gt_frames``
        and, for a known environment, ``env`` and ``ground_truth`` (observed true states)."""
        if len(dataset) == 0:
            raise ValueError(f"the {split} set has no world-model windows")
        if dataset.future.shape[1] != self.tokens.future:
            raise ValueError(
                f"{split} windows hold {dataset.future.shape[1]} future frames; the model predicts "
                f"{self.tokens.future}"
            )
        input_ids = self.encode_windows(dataset)
        mask = torch.ones_like(input_ids)
        non_tensor: dict[str, Any] = {"extra_info": [{"source": s} for s in dataset.sources]}
        if dataset.env is not None:
            from mmrl.worldmodel.envs import make_env

            env = make_env(dataset.env["name"], **dataset.env["config"])
            non_tensor["env"] = [dataset.env] * len(dataset)
            non_tensor["ground_truth"] = [
                [env.state_from_frame(f) for f in fut] for fut in dataset.future
            ]
        forced = self.forced_ids(dataset)
        batch = Batch.from_dict(
            tensors={
                **({FORCED_KEY: forced} if forced is not None else {}),
                "input_ids": input_ids,
                FRAME_END_KEY: torch.from_numpy(self.tokens.frame_end_steps())
                .expand(len(input_ids), -1)
                .clone(),
                "attention_mask": mask,
                "position_ids": torch.arange(input_ids.shape[1]).expand_as(input_ids).clone(),
                "gt_frames": torch.from_numpy(np.ascontiguousarray(dataset.future)),
                "last_context_frame": torch.from_numpy(dataset.context[:, -1].copy()),
                "last_context_decoded": torch.from_numpy(
                    self.tokenizer.decode(self.tokenizer.encode(dataset.context[:, -1]))
                ),
            },
            non_tensor={k: _object_array(v) for k, v in non_tensor.items()},
            meta={"num_filtered_prompts": 0},
        )
        return batch

    def decode(self, batch: Batch) -> Batch:
        """Add ``pred_frames`` float32 [B, F, H, W, 3] (NaN where undecodable) and
        ``decode_error``."""
        frames, valid, reasons = self.tokens.decode_frames(
            batch["responses"].tolist(), self.tokenizer
        )
        pred = torch.from_numpy(frames).float().div_(255.0)
        pred[torch.from_numpy(~valid)] = float("nan")
        batch["pred_frames"] = pred
        batch["decode_error"] = _object_array(reasons)
        return batch

    def sampling_overrides(self) -> dict[str, Any]:
        """Visual tokens only, exactly ``response_length`` steps (interleaved: the forced actions
        between frames are written by the engine, see ``forced_response_ids``)."""
        n = self.tokens.response_length
        return {
            "allowed_token_ids": tuple(self.tokens.allowed_token_ids()),
            "min_tokens": n,
            "max_tokens": n,
        }


def _object_array(values: Sequence[Any]) -> np.ndarray:
    out = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):
        out[i] = v
    return out
