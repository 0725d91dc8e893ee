"""A tiny Qwen2-VL and its processor, assembled from configs with no downloads.

Tests, benchmarks and the procedural visual tasks use it. Everything is written
with ``save_pretrained`` and read back with ``from_pretrained``, so the loading
code that runs in tests is the code that loads a real checkpoint.

The tokenizer is byte-level (256 byte tokens, no merges) plus the Qwen2-VL
special tokens and the ``<think>``/``<answer>`` tags, so any text encodes and
the vocabulary stays small.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models
from tokenizers.pre_tokenizers import ByteLevel
from transformers import (
    PreTrainedTokenizerFast,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen2VLImageProcessor,
    Qwen2VLProcessor,
    Qwen2VLVideoProcessor,
)

PAD, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"
IMAGE_PAD, VIDEO_PAD = "<|image_pad|>", "<|video_pad|>"
SPECIAL_TOKENS = [PAD, IM_START, IM_END, VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD]
# Plain added tokens: kept when decoding with skip_special_tokens, so verifiers see them.
TAG_TOKENS = ["<think>", "</think>", "<answer>", "</answer>"]

# Qwen2-VL's chat template, without the default system message: list contents
# place one <|image_pad|>/<|video_pad|> per image/video; the processor expands
# each into grid_t * grid_h * grid_w / merge_size**2 tokens.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Small images: a 56x56..112x112 image becomes 4x4..8x8 patches of 14 px, i.e. 4..16 tokens.
DEFAULT_PIXELS = {"min_pixels": 56 * 56, "max_pixels": 112 * 112}
DEFAULT_TEXT = {
    "hidden_size": 64,  # head_dim 64: the vLLM CPU attention kernel refuses 16
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 1,
    "num_key_value_heads": 1,
    "max_position_embeddings": 1024,
    # mrope splits head_dim / 2 = 32 rotary frequencies over (t, h, w).
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "mrope_section": [8, 12, 12],
    },
}
DEFAULT_VISION = {
    "depth": 1,
    "embed_dim": 32,
    "num_heads": 2,
    "mlp_ratio": 2,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
}


def build_vlm_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer with the Qwen2-VL special tokens and chat template."""
    vocab = {ch: i for i, ch in enumerate(sorted(ByteLevel.alphabet()))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    core.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAG_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD,
        eos_token=IM_END,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


def build_tiny_qwen2_vl_processor(min_pixels: int, max_pixels: int) -> Qwen2VLProcessor:
    """Image processor, ``Qwen2VLVideoProcessor`` and tokenizer in one ``Qwen2VLProcessor``.

    ``min_pixels``/``max_pixels`` bound the resized area of images and of each video frame.
    """
    size = {"shortest_edge": min_pixels, "longest_edge": max_pixels}
    return Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(size=size),
        video_processor=Qwen2VLVideoProcessor(size=size),
        tokenizer=build_vlm_tokenizer(),
        chat_template=CHAT_TEMPLATE,
    )


def tiny_qwen2_vl_config(
    tokenizer: PreTrainedTokenizerFast,
    text: dict[str, Any] | None = None,
    vision: dict[str, Any] | None = None,
    tie_word_embeddings: bool = False,
) -> Qwen2VLConfig:
    """A Qwen2-VL config sized for CPU tests; ``text``/``vision`` override the defaults."""
    text_cfg = {**DEFAULT_TEXT, **(text or {})}
    vision_cfg = {**DEFAULT_VISION, **(vision or {}), "hidden_size": text_cfg["hidden_size"]}
    ids = tokenizer.convert_tokens_to_ids
    return Qwen2VLConfig(
        text_config={
            **text_cfg,
            "vocab_size": len(tokenizer),
            "pad_token_id": tokenizer.pad_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "bos_token_id": None,
        },
        vision_config=vision_cfg,
        image_token_id=ids(IMAGE_PAD),
        video_token_id=ids(VIDEO_PAD),
        vision_start_token_id=ids(VISION_START),
        vision_end_token_id=ids(VISION_END),
        tie_word_embeddings=tie_word_embeddings,
    )


def build_tiny_qwen2_vl(
    out_dir: str | Path,
    seed: int = 0,
    min_pixels: int = DEFAULT_PIXELS["min_pixels"],
    max_pixels: int = DEFAULT_PIXELS["max_pixels"],
    text: dict[str, Any] | None = None,
    vision: dict[str, Any] | None = None,
    tie_word_embeddings: bool = False,
) -> Path:
    """Write a random tiny ``Qwen2VLForConditionalGeneration`` and its processor to ``out_dir``.

    Load them back with ``AutoModelForImageTextToText.from_pretrained(out_dir)`` and
    ``AutoProcessor.from_pretrained(out_dir)``. Returns ``out_dir``.
    """
    out_dir = Path(out_dir)
    processor = build_tiny_qwen2_vl_processor(min_pixels, max_pixels)
    config = tiny_qwen2_vl_config(processor.tokenizer, text, vision, tie_word_embeddings)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2VLForConditionalGeneration(config)
    model.generation_config.pad_token_id = processor.tokenizer.pad_token_id
    model.generation_config.eos_token_id = processor.tokenizer.eos_token_id
    model.save_pretrained(out_dir, safe_serialization=True)
    processor.save_pretrained(out_dir)
    return out_dir
