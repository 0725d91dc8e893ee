"""VLM processor: prompts with images and videos to model inputs, through the model's HF processor.

One sample is a chat-template prompt with one ``<|image_pad|>`` per image and one
``<|video_pad|>`` per video (:func:`chat_prompt` builds it from ``<image>`` text), plus
its media. :meth:`VisionProcessor.encode` turns samples into a :class:`~mmrl.protocol.Batch`:

- ``input_ids``, ``attention_mask`` [B, P]: left-padded to ``max_prompt_length``;
- ``position_ids`` [B, 3, P]: mrope positions computed once, by the model's own
  ``get_rope_index``. mmrl keeps the model's 3 rows (temporal, height, width); it does
  not prepend verl's 4th text row. Response positions come from
  :func:`~mmrl.models.vlm_inputs.extend_position_ids`;
- non-tensor ``multi_modal_inputs``: a dict of tensors per sample (layout in
  :mod:`mmrl.models.vlm_inputs`); ``raw_prompt``; ``multi_modal_data`` (the raw
  media, only with ``keep_raw_media``).

Processed prompts are cached by content (or by ``VisionSample.key``), so the n rollouts of
a prompt, and the same prompt in a later epoch, share one processed copy.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoConfig, AutoModel, AutoProcessor, PretrainedConfig, ProcessorMixin

from mmrl.config import DataConfig
from mmrl.errors import DataError
from mmrl.models.vlm_inputs import (
    IMAGE_KEYS,
    VIDEO_KEYS,
    check_vision_tokens,
    mm_token_type_ids,
)
from mmrl.processors.media import (
    ImageInput,
    MediaError,
    VideoInput,
    load_image,
    media_digest,
    read_video,
)
from mmrl.processors.text import PromptTooLongError, TextProcessor
from mmrl.protocol import Batch

PIXEL_KEYS = ("pixel_values", "pixel_values_videos")
RopeIndexFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
PLACEHOLDER = re.compile(r"<(image|video)>")


@dataclass
class VisionSample:
    """A prompt and its media, in placeholder order.

    ``images``: PIL images, encoded bytes, paths, or ``{"bytes", "path"}`` dicts (the
    parquet struct). ``videos``: mp4 paths or bytes (read with decord) or uint8 frames
    [F, H, W, 3] already sampled. ``key``: a stable identity for the cache (e.g.
    ``"train/17"``); None hashes the content.
    """

    prompt: str
    images: list[ImageInput] = field(default_factory=list)
    videos: list[VideoInput] = field(default_factory=list)
    key: str | None = None


@dataclass
class ProcessedPrompt:
    """One prompt after processing: ``input_ids`` [L], ``position_ids`` [3, L], visual inputs."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    multi_modal_inputs: dict[str, torch.Tensor]
    num_truncated_tokens: int = 0


def chat_prompt(processor: ProcessorMixin, problem: str, system: str | None = None) -> str:
    """Chat-template text for ``problem``, whose ``<image>``/``<video>`` mark where media go."""
    content: list[dict[str, str]] = []
    for i, part in enumerate(PLACEHOLDER.split(problem)):
        if i % 2 == 1:
            content.append({"type": part})
        elif part:
            content.append({"type": "text", "text": part})
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": content}
    ]
    return processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def model_rope_index(config: PretrainedConfig) -> RopeIndexFn:
    """The model's own ``get_rope_index``, bound to a weightless (meta-device) base model."""
    with torch.device("meta"):
        base = AutoModel.from_config(config)
    if not hasattr(base, "get_rope_index"):
        raise TypeError(f"{type(base).__name__} has no get_rope_index; it is not an mrope VLM")
    return base.get_rope_index


class VisionProcessor:
    """Owns the token layout of VLM prompts: tokens, mrope positions and visual inputs."""

    def __init__(self, processor: ProcessorMixin, cfg: DataConfig, rope_index: RopeIndexFn) -> None:
        self.processor, self.cfg, self.rope_index = processor, cfg, rope_index
        self.tokenizer = processor.tokenizer
        self.image_token_id = int(processor.image_token_id)
        self.video_token_id = int(processor.video_token_id)
        ids = self.tokenizer.convert_tokens_to_ids
        self.vision_start_id, self.vision_end_id = ids("<|vision_start|>"), ids("<|vision_end|>")
        self.special_ids = torch.tensor(
            sorted(i for i, t in self.tokenizer.added_tokens_decoder.items() if t.special)
        )
        self.merge_size = int(processor.image_processor.merge_size)
        self.temporal_patch_size = int(processor.video_processor.temporal_patch_size)
        self._text = TextProcessor(self.tokenizer, cfg.max_prompt_length)
        self._cache: OrderedDict[str, ProcessedPrompt] = OrderedDict()
        self.cache_hits = self.cache_misses = 0

    @classmethod
    def from_pretrained(cls, path: str | Path, cfg: DataConfig) -> VisionProcessor:
        """Load the HF processor and the model config saved in ``path`` (no weights are read)."""
        processor = AutoProcessor.from_pretrained(path, local_files_only=True)
        return cls(
            processor,
            cfg,
            model_rope_index(AutoConfig.from_pretrained(path, local_files_only=True)),
        )

    @property
    def pad_token_id(self) -> int:
        return int(self.tokenizer.pad_token_id)

    @property
    def eos_token_id(self) -> int:
        return int(self.tokenizer.eos_token_id)

    # ----- one prompt ----------------------------------------------------------------

    def process(self, sample: VisionSample, sample_id: int = 0) -> ProcessedPrompt:
        """Process one sample, or return the cached result for the same content."""
        key = (
            sample.key
            if sample.key is not None
            else media_digest(sample.prompt, [*sample.images, *sample.videos])
        )
        if key in self._cache:
            self.cache_hits += 1
            self._cache.move_to_end(key)
            return self._cache[key]
        self.cache_misses += 1
        out = self._process(sample, sample_id)
        if self.cfg.cache_size > 0:
            self._cache[key] = out
            if len(self._cache) > self.cfg.cache_size:
                self._cache.popitem(last=False)
        return out

    def _process(self, sample: VisionSample, sample_id: int) -> ProcessedPrompt:
        self._check_placeholders(sample, sample_id)
        try:
            media = self.load_multi_modal_data(sample)
        except MediaError as err:  # name the sample: the message names only the file
            raise type(err)(f"sample {sample_id}: {err}") from err
        kwargs: dict[str, Any] = {"return_tensors": "pt"}
        if media["image"]:
            kwargs["images"] = media["image"]
            kwargs["images_kwargs"] = self._size_kwargs(
                "image_processor", self.cfg.min_pixels, self.cfg.max_pixels
            )
        if media["video"]:
            frames, metadata = zip(*media["video"], strict=True)
            kwargs["videos"] = list(frames)
            kwargs["videos_kwargs"] = {
                **self._size_kwargs(
                    "video_processor", self.cfg.video_min_pixels, self.cfg.video_max_pixels
                ),
                "do_sample_frames": False,
                "video_metadata": list(metadata),
            }
        out = self.processor(text=[sample.prompt], **kwargs)
        mm = {k: torch.as_tensor(out[k]) for k in IMAGE_KEYS + VIDEO_KEYS if k in out}
        input_ids, n_cut = self._fit_length(out["input_ids"][0], sample_id)
        check_vision_tokens(
            input_ids[None],
            [mm],
            self.image_token_id,
            self.video_token_id,
            self.merge_size,
            [sample_id],
        )
        # Positions of the final (truncated) tokens, by the model's own rope index: [3, 1, L].
        token_types = mm_token_type_ids(input_ids[None], self.image_token_id, self.video_token_id)
        grids = {k: v for k, v in mm.items() if k not in PIXEL_KEYS}
        position_ids, _ = self.rope_index(input_ids[None], mm_token_type_ids=token_types, **grids)
        return ProcessedPrompt(input_ids, position_ids[:, 0].clone(), mm, n_cut)

    def load_multi_modal_data(self, sample: VisionSample) -> dict[str, list]:
        """``{"image": [PIL RGB], "video": [(frames uint8 [F, H, W, 3], VideoMetadata)]}``."""
        return {
            "image": [
                load_image(x, self.cfg.max_image_bytes, self.cfg.max_image_pixels)
                for x in sample.images
            ],
            "video": [read_video(v, **self.video_sampling) for v in sample.videos],
        }

    @property
    def video_sampling(self) -> dict[str, Any]:
        """How videos become frames (:func:`~mmrl.processors.media.read_video` arguments)."""
        c = self.cfg
        return {
            "fps": c.video_fps,
            "min_frames": c.video_min_frames,
            "max_frames": c.video_max_frames,
            "frame_multiple": self.temporal_patch_size,
            "max_video_frames": c.max_video_frames,
        }

    def _size_kwargs(
        self, which: str, min_pixels: int | None, max_pixels: int | None
    ) -> dict[str, Any]:
        if min_pixels is None and max_pixels is None:
            return {}
        size = dict(getattr(self.processor, which).size)
        size["shortest_edge"] = min_pixels or size["shortest_edge"]
        size["longest_edge"] = max_pixels or size["longest_edge"]
        return {"size": size}

    def _check_placeholders(self, sample: VisionSample, sample_id: int) -> None:
        for kind, token, items in (
            ("image", "<|image_pad|>", sample.images),
            ("video", "<|video_pad|>", sample.videos),
        ):
            found = sample.prompt.count(token)
            if found != len(items):
                hint = (
                    " The prompt looks processed already (expanded placeholders)."
                    if found > len(items) > 0
                    else " Build prompts with mmrl.processors.chat_prompt, which turns "
                    "<image>/<video> "
                    "into one placeholder each."
                )
                raise DataError(
                    f"sample {sample_id}: prompt has {found} {token} placeholders but {len(items)} "
                    f"{kind}s "
                    f"were given; expected one placeholder per {kind}.{hint}"
                )

    def _fit_length(self, input_ids: torch.Tensor, sample_id: int) -> tuple[torch.Tensor, int]:
        """Drop text tokens per ``cfg.truncation`` until the prompt fits; never vision or special
        tokens.
        """
        limit, n = self.cfg.max_prompt_length, len(input_ids)
        if n <= limit:
            return input_ids, 0
        protected = self._protected(input_ids)
        n_vision = int(
            ((input_ids == self.image_token_id) | (input_ids == self.video_token_id)).sum()
        )
        removable = (~protected).nonzero().flatten()
        excess = n - limit
        if self.cfg.truncation == "error" or len(removable) < excess:
            why = (
                "data.truncation='error'"
                if self.cfg.truncation == "error"
                else f"even without its {len(removable)} text tokens it has {n - len(removable)} "
                "vision and special tokens"
            )
            raise PromptTooLongError(
                f"sample {sample_id}: prompt has {n} tokens ({n_vision} of them vision tokens), "
                "more than "
                f"data.max_prompt_length={limit}, and {why}. Raise max_prompt_length, lower "
                "max_pixels "
                f"({self.cfg.max_pixels or self.processor.image_processor.size['longest_edge']}) "
                f"or video_max_frames ({self.cfg.video_max_frames}), "
                "set data.truncation=left|right, or set data.filter_overlong_prompts=true to drop "
                "it"
            )
        drop = removable[:excess] if self.cfg.truncation == "left" else removable[-excess:]
        keep = torch.ones(n, dtype=torch.bool)
        keep[drop] = False
        return input_ids[keep], excess

    def _protected(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[L] bool: special tokens, and everything from a vision start to its vision end."""
        starts = (input_ids == self.vision_start_id).long()
        ends = (input_ids == self.vision_end_id).long()
        inside = (starts - ends).cumsum(0) > 0
        return inside | ends.bool() | torch.isin(input_ids, self.special_ids)

    # ----- batches -------------------------------------------------------------------

    def encode(
        self,
        samples: Sequence[VisionSample],
        non_tensor: Mapping[str, Sequence] | None = None,
        sample_ids: Sequence[int] | None = None,
    ) -> Batch:
        """A prompt Batch of ``samples``: the fields listed in the module docstring.

        Overlong prompts raise :class:`PromptTooLongError`, or are dropped with
        ``filter_overlong_prompts`` (``meta["num_filtered_prompts"]``); text-truncated ones
        are counted in ``meta["num_truncated_prompts"]``.
        """
        if len(samples) == 0:
            raise ValueError("no prompts to encode: the dataset or batch is empty")
        sample_ids = list(range(len(samples))) if sample_ids is None else list(sample_ids)
        keep, done = [], []
        for i, sample in enumerate(samples):
            try:
                done.append(self.process(sample, sample_ids[i]))
                keep.append(i)
            except PromptTooLongError:
                if not self.cfg.filter_overlong_prompts:
                    raise
        if not keep:
            raise PromptTooLongError(f"all {len(samples)} prompts exceed data.max_prompt_length")
        width = self.cfg.max_prompt_length
        input_ids = torch.full((len(keep), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(keep), width), dtype=torch.long)
        position_ids = torch.zeros((len(keep), 3, width), dtype=torch.long)
        for row, p in enumerate(done):
            n = len(p.input_ids)
            input_ids[row, width - n :] = p.input_ids
            attention_mask[row, width - n :] = 1
            position_ids[row, :, width - n :] = p.position_ids
        per_sample = {k: _take(v, keep) for k, v in (non_tensor or {}).items()}
        per_sample["raw_prompt"] = _take([s.prompt for s in samples], keep)
        # Shared with the cache: treat these dicts as read-only.
        per_sample["multi_modal_inputs"] = _take(
            [p.multi_modal_inputs for p in done], range(len(done))
        )
        if self.cfg.keep_raw_media:
            # With the frame sampling, so that the vLLM engine decodes the same frames from a video.
            raw = [
                {"image": s.images, "video": s.videos, "video_sampling": self.video_sampling}
                for s in samples
            ]
            per_sample["multi_modal_data"] = _take(raw, keep)
        return Batch.from_dict(
            tensors={
                "input_ids": input_ids,
                "attention_mask": attention_mask,
                "position_ids": position_ids,
            },
            non_tensor=per_sample,
            meta={
                "num_filtered_prompts": len(samples) - len(keep),
                "num_truncated_prompts": sum(p.num_truncated_tokens > 0 for p in done),
            },
        )

    def decode_responses(self, responses: torch.Tensor, response_mask: torch.Tensor) -> list[str]:
        """Decode ``responses`` [B, T] up to their mask, without the EOS token."""
        return self._text.decode_responses(responses, response_mask)

    def clear_cache(self) -> None:
        self._cache.clear()

    def cache_info(self) -> dict[str, int]:
        """Hits, misses, entries and the bytes held by cached tensors."""
        held = sum(
            t.numel() * t.element_size()
            for p in self._cache.values()
            for t in (p.input_ids, p.position_ids, *p.multi_modal_inputs.values())
        )
        return {
            "hits": self.cache_hits,
            "misses": self.cache_misses,
            "entries": len(self._cache),
            "bytes": held,
        }


def _take(values: Sequence[Any], rows: Sequence[int]) -> np.ndarray:
    out = np.empty(len(rows), dtype=object)
    for j, i in enumerate(rows):
        out[j] = values[i]
    return out
