"""The VLM family, and model calls on VLM batches: log-probs for training, HF generation.

Batches follow the layout of :mod:`mmrl.processors.vision`: ``input_ids`` and
``attention_mask`` [B, L], mrope ``position_ids`` [B, 3, L] and non-tensor
``multi_modal_inputs``. Visual inputs are collated per call, so any row slice of a Batch
(a micro-batch) is a valid input.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor

from mmrl.models.family import PolicyFamily, VLLMServing, register_family
from mmrl.models.responses import finish_rollout, generated_responses
from mmrl.models.row_sampling import seeded_sampling_processors
from mmrl.models.text_lm import TextLMFamily, has_vision_tower, response_scores
from mmrl.models.vlm_inputs import (
    MODEL_VISUAL_KEYS,
    check_vision_tokens,
    collate_multi_modal,
    mm_token_type_ids,
)
from mmrl.protocol import Batch
from mmrl.sampling import SamplingParams

# Config fields naming the vision tokens: the two placeholders first, then start and end.
VISION_TOKENS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")


def _vision_ids(model: nn.Module) -> tuple[int, int, int]:
    config = model.config
    return (
        int(config.image_token_id),
        int(config.video_token_id),
        int(config.vision_config.spatial_merge_size),
    )


def suppressed_token_ids(model: nn.Module) -> list[int]:
    """Vision tokens a response must not contain: placeholders, vision start and end.

    A sampled ``<|image_pad|>`` would be taken for an image placeholder when the response
    is fed back for log-probs ("image features and image tokens do not match"). Rollouts
    never sample these ids, and :func:`vlm_response_log_probs` gives them zero probability,
    so rollout and training describe the same distribution.
    """
    config = model.config
    return sorted(
        {int(getattr(config, n)) for n in VISION_TOKENS if getattr(config, n, None) is not None}
    )


def check_responses(model: nn.Module, batch: Batch) -> None:
    """Raise if a (valid) response token of ``batch`` is one of :func:`suppressed_token_ids`."""
    responses = batch["responses"]
    sampled = torch.isin(
        responses, torch.tensor(suppressed_token_ids(model), device=responses.device)
    )
    if "response_mask" in batch:
        sampled &= batch["response_mask"].bool()
    if sampled.any():
        row, col = (int(x) for x in sampled.nonzero()[0])
        raise ValueError(
            f"sample {row}: response token {col} is the vision token id "
            f"{int(responses[row, col])}; "
            "the rollout must never sample suppressed_token_ids(model) (pass them to the engine "
            "as suppressed/bad tokens)"
        )


def visual_model_inputs(model: nn.Module, batch: Batch) -> dict[str, torch.Tensor]:
    """Checked, collated visual inputs of ``batch`` for the model's forward, on its device.

    Raises :class:`~mmrl.models.vlm_inputs.VisionTokenMismatchError` (naming the row
    of ``batch``) before any model call when tokens and features disagree.
    """
    image_id, video_id, merge = _vision_ids(model)
    if "responses" in batch:
        check_responses(model, batch)
    rows = (
        list(batch["multi_modal_inputs"]) if "multi_modal_inputs" in batch else [None] * len(batch)
    )
    check_vision_tokens(batch["input_ids"], rows, image_id, video_id, merge)
    collated = collate_multi_modal(rows)
    device = batch["input_ids"].device
    return {k: collated[k].to(device) for k in MODEL_VISUAL_KEYS if k in collated}


def vlm_forward_logits(model: nn.Module, batch: Batch, logits_to_keep: int = 0) -> torch.Tensor:
    """Logits [b, L, V] of a Qwen-VL style model on ``batch`` (any row slice of a VLM Batch);
    with ``logits_to_keep`` > 0, of the last that many positions only.

    ``position_ids`` [b, 3, L] are passed as the model's [3, b, L], so the model never
    recomputes them from padded inputs.
    """
    position_ids = batch["position_ids"]
    if position_ids.ndim != 3:
        raise ValueError(f"VLM position_ids must be [B, 3, L], found {list(position_ids.shape)}")
    return model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        position_ids=position_ids.transpose(0, 1),
        use_cache=False,
        logits_to_keep=logits_to_keep,
        **visual_model_inputs(model, batch),
    ).logits


def vlm_response_log_probs(
    model: nn.Module,
    batch: Batch,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs [b, T] of ``batch["responses"]`` (and entropy [b, T]), logits divided by
    ``temperature``.
    """
    # The logit at position i predicts token i + 1: the last T+1..1 positions score the response.
    logits = vlm_forward_logits(model, batch, logits_to_keep=batch["responses"].shape[1] + 1)
    logits = logits[:, :-1].float() / temperature
    # As in the rollout; the finite minimum keeps the entropy's p * z term at 0, not NaN.
    logits[..., suppressed_token_ids(model)] = torch.finfo(logits.dtype).min
    # And under what else the engine sampled with (padded vocabulary rows, allowed ids, min length).
    return response_scores(logits, batch, with_entropy, entropy_grad)


def _init_fsdp_root(model: nn.Module) -> None:
    """Make an FSDP2-wrapped model its own root before ``generate``.

    FSDP2 takes the first module that runs forward as the root. transformers' VLM
    ``generate`` encodes the images with the vision tower before the model's first
    forward, which would make a vision block the root and fail that forward.
    """
    get_state = getattr(model, "_get_fsdp_state", None)
    if get_state is not None:
        get_state()._lazy_init()


@torch.no_grad()
def generate_vlm(
    model: nn.Module, prompts: Batch, sampling: SamplingParams, eos_token_id: int, pad_token_id: int
) -> Batch:
    """One response per row with transformers ``generate``; the rollout fields of ``RolloutEngine``.

    Adds ``responses``, ``response_mask``, ``rollout_log_probs`` [B, T] and extends
    ``input_ids``/``attention_mask`` to [B, P + T] and ``position_ids`` to [B, 3, P + T].
    ``multi_modal_inputs`` of the result are the same objects as the prompts' (not copied).
    """
    if sampling.allowed_token_ids is not None or sampling.min_tokens:
        raise NotImplementedError(
            "generate_vlm supports no allowed_token_ids/min_tokens constraints"
        )
    image_id, video_id, _ = _vision_ids(model)
    stop_ids = {eos_token_id, *sampling.stop_token_ids}
    visual = visual_model_inputs(model, prompts)
    _init_fsdp_root(model)
    was_training = model.training
    model.eval()
    # Each row draws from its own seed (mmrl.models.row_sampling); generate takes the draw.
    processors, sampler = (
        seeded_sampling_processors(prompts, sampling) if sampling.do_sample else (None, None)
    )
    # generate recomputes mrope positions with the same get_rope_index from these token types.
    out = model.generate(
        input_ids=prompts["input_ids"],
        attention_mask=prompts["attention_mask"],
        mm_token_type_ids=mm_token_type_ids(prompts["input_ids"], image_id, video_id),
        **visual,
        max_new_tokens=sampling.max_tokens,
        do_sample=False,
        logits_processor=processors,
        eos_token_id=sorted(stop_ids),
        pad_token_id=pad_token_id,
        suppress_tokens=suppressed_token_ids(model),
        output_scores=sampler is None,
        return_dict_in_generate=True,
    )
    model.train(was_training)
    scores = out.scores if sampler is None else sampler.scores
    responses, log_probs = generated_responses(
        out.sequences, scores, prompts["input_ids"].shape[1], sampling.max_tokens, pad_token_id
    )

    # Extends the mrope positions; multi_modal_inputs are carried by reference.
    return finish_rollout(prompts, responses, log_probs, stop_ids, pad_token_id)


@register_family("vlm")
class VLMFamily(TextLMFamily):
    """A Qwen-VL style ``save_pretrained`` folder: the config has a vision tower, and the
    image/video processor is saved beside the weights.

    A batch without ``multi_modal_inputs`` (text prompts, 1-D positions) takes the text
    LM's path, so a VLM checkpoint also trains on a text task.
    """

    auto_class = AutoModelForImageTextToText
    packs_rows = False  # rows carry their images' tokens and 3-D rope positions
    drops_finished_rows = False  # generate computes the 3-D positions of text-only rows too
    # transformers has no token-classification head for these configs: no critic (GAE).
    has_critic = False
    load_critic = PolicyFamily.load_critic
    values = PolicyFamily.values

    def detect(self, path: Path) -> bool:
        return (path / "config.json").is_file() and has_vision_tower(path)

    def describe(self) -> str:
        return "a transformers save_pretrained folder whose config.json has a vision_config"

    def save(
        self, model: nn.Module, path: Path, state_dict: dict[str, torch.Tensor], source: Path
    ) -> None:
        model.save_pretrained(path, state_dict=state_dict, safe_serialization=True)
        # The processor (image/video settings and the tokenizer) travels with the weights.
        AutoProcessor.from_pretrained(source, local_files_only=True).save_pretrained(path)

    def response_log_probs(
        self,
        model: nn.Module,
        batch: Batch,
        temperature: float = 1.0,
        with_entropy: bool = False,
        entropy_grad: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if "multi_modal_inputs" not in batch:
            return super().response_log_probs(model, batch, temperature, with_entropy, entropy_grad)
        return vlm_response_log_probs(model, batch, temperature, with_entropy, entropy_grad)

    def generate(
        self, model: nn.Module, prompts: Batch, sampling: SamplingParams, tokenizer: Any
    ) -> Batch:
        if "multi_modal_inputs" not in prompts:
            return super().generate(model, prompts, sampling, tokenizer)
        eos_id, pad_id = int(tokenizer.eos_token_id), int(tokenizer.pad_token_id)
        return generate_vlm(model, prompts, sampling, eos_id, pad_id)

    def vllm_serving(self, path: Path, tokenizer: Any) -> VLLMServing:
        """Vision tokens and padded vocabulary rows (ids past the tokenizer's) are never
        sampled; image/video placeholders are expanded by vLLM's processor."""
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        if getattr(config, "image_token_id", None) is None:
            return VLLMServing()
        ids = {n: getattr(config, n, None) for n in VISION_TOKENS}
        vision = {int(i) for i in ids.values() if i is not None}
        padded = range(len(tokenizer), config.get_text_config().vocab_size)
        placeholders = tuple(int(ids[n]) for n in VISION_TOKENS[:2] if ids[n] is not None)
        return VLLMServing(placeholders, tuple(sorted({*vision, *padded})), multimodal=True)
