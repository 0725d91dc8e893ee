"""The Qwen2.5-VL-7B GPU example: it composes, and the model it names fits its settings (no
download).
"""

from __future__ import annotations

import json

import torch
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

from mmrl.config import compose, config_dir
from mmrl.processors.vision import model_rope_index

EXAMPLE = "examples/qwen2_5_vl_7b_gpu"
ARCH = config_dir() / "examples" / "qwen2_5_vl_7b_instruct_config.json"
TOKENIZER_SIZE = 151_665  # len(tokenizer) of Qwen2.5-VL: 151,643 BPE tokens + 22 special tokens


def compose_example():
    return compose(
        [
            "actor_rollout_ref.model.path=/models/Qwen2.5-VL-7B-Instruct",
            "task.train_files=[/data/geo3k/train.parquet]",
        ],
        config_name=EXAMPLE,
    )


def test_example_composes_with_the_users_paths():
    cfg = compose_example()
    assert cfg.task.name == "vision_parquet"
    assert (
        cfg.task.model_path == "/models/Qwen2.5-VL-7B-Instruct"
    )  # interpolated from the model path
    assert list(cfg.task.train_files) == ["/data/geo3k/train.parquet"]
    assert cfg.actor_rollout_ref.rollout.name == "vllm" and cfg.algorithm.adv_estimator == "grpo"
    assert [v.name for v in cfg.reward.verifiers] == ["math_answer", "format"]
    vision = cfg.data
    assert (
        vision.max_prompt_length == 1024
        and vision.max_pixels == 512 * 512
        and vision.keep_raw_media
    )


def test_example_model_builds_on_meta_and_fits_the_settings():
    cfg = compose_example()
    config = Qwen2_5_VLConfig(**json.loads(ARCH.read_text()))
    with torch.device("meta"):
        model = Qwen2_5_VLForConditionalGeneration(config)
    assert next(model.parameters()).device.type == "meta"
    n_params = sum(p.numel() for p in model.parameters())
    assert 8.2e9 < n_params < 8.4e9  # Qwen2.5-VL-7B: 8.29B with the vision tower
    text = config.text_config

    # Lengths: prompt + response fit the context, and one max-size image fits the prompt.
    data = cfg.data
    assert data.max_prompt_length + data.max_response_length <= text.max_position_embeddings
    patch, merge = config.vision_config.patch_size, config.vision_config.spatial_merge_size
    side = int(data.max_pixels**0.5)
    h, w = smart_resize(
        side, side, factor=patch * merge, min_pixels=data.min_pixels, max_pixels=data.max_pixels
    )
    image_tokens = (h // patch) * (w // patch) // merge**2
    assert image_tokens == 324 and image_tokens + 128 <= data.max_prompt_length
    # Vocabulary: every tokenizer id and every vision id has an embedding row.
    assert model.get_input_embeddings().num_embeddings == text.vocab_size >= TOKENIZER_SIZE
    assert (
        max(config.image_token_id, config.video_token_id, config.vision_end_token_id)
        < TOKENIZER_SIZE
    )
    # Batch divisibility: prompts into mini-batches, samples over GPUs, micro-batches per GPU.
    actor, rollout, trainer = (
        cfg.actor_rollout_ref.actor,
        cfg.actor_rollout_ref.rollout,
        cfg.trainer,
    )
    world = trainer.n_workers_per_node * trainer.nnodes
    samples = data.train_batch_size * rollout.n
    assert data.train_batch_size % actor.ppo_mini_batch_size == 0
    assert samples % world == 0 and data.val_batch_size % world == 0
    assert (actor.ppo_mini_batch_size * rollout.n // world) % actor.ppo_micro_batch_size == 0
    assert (samples // world) % rollout.log_prob_micro_batch_size == 0
    assert (samples // world) % cfg.actor_rollout_ref.ref.log_prob_micro_batch_size == 0
    # mrope: the rotary sections cover head_dim / 2 frequencies.
    head_dim = text.hidden_size // text.num_attention_heads
    assert sum(text.rope_parameters["mrope_section"]) == head_dim // 2


def test_rope_index_of_the_7b_config_runs_without_weights():
    config = Qwen2_5_VLConfig(**json.loads(ARCH.read_text()))
    rope_index = model_rope_index(config)
    ids = torch.tensor(
        [
            [
                1,
                2,
                config.vision_start_token_id,
                *[config.image_token_id] * 4,
                config.vision_end_token_id,
                5,
            ]
        ]
    )
    positions, _ = rope_index(
        ids,
        mm_token_type_ids=(ids == config.image_token_id).long(),
        image_grid_thw=torch.tensor([[1, 4, 4]]),
    )
    assert positions[:, 0].tolist() == [
        [0, 1, 2, 3, 3, 3, 3, 5, 6],
        [0, 1, 2, 3, 3, 4, 4, 5, 6],
        [0, 1, 2, 3, 4, 3, 4, 5, 6],
    ]
