"""VLM log-probs and generation: batching, padding and mrope positions must not change results."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from mmrl.config import DataConfig
from mmrl.models.tiny_vlm import build_tiny_qwen2_vl
from mmrl.models.vlm import (
    generate_vlm,
    suppressed_token_ids,
    vlm_forward_logits,
    vlm_response_log_probs,
)
from mmrl.models.vlm_inputs import VisionTokenMismatchError
from mmrl.processors import VisionProcessor, VisionSample, chat_prompt
from mmrl.protocol import Batch
from mmrl.sampling import SamplingParams


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoModelForImageTextToText

    path = build_tiny_qwen2_vl(tmp_path_factory.mktemp("tiny_vlm"), seed=1)
    model = AutoModelForImageTextToText.from_pretrained(path, local_files_only=True).eval()
    proc = VisionProcessor.from_pretrained(path, DataConfig(max_prompt_length=80))
    return model, proc


def image(h: int, w: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8))


def mixed_prompts(proc: VisionProcessor) -> Batch:
    """Image, text-only, two images, video, image + video: different lengths, so different
    padding."""
    p, rng = proc.processor, np.random.default_rng(0)
    video = rng.integers(0, 255, (4, 56, 56, 3), dtype=np.uint8)
    return proc.encode(
        [
            VisionSample(chat_prompt(p, "<image>How many?"), [image(60, 90, 0)]),
            VisionSample(chat_prompt(p, "Only text in this prompt")),
            VisionSample(
                chat_prompt(p, "<image> or <image>?"), [image(112, 112, 1), image(40, 80, 2)]
            ),
            VisionSample(chat_prompt(p, "<video>Moves?"), videos=[video]),
            VisionSample(chat_prompt(p, "<image><video>"), [image(56, 56, 3)], [video]),
        ]
    )


def with_responses(prompts: Batch, seed: int = 0, length: int = 6, vocab: int = 256) -> Batch:
    """Append random text responses (byte tokens), with mrope positions extended."""
    from mmrl.models.vlm_inputs import extend_position_ids

    g = torch.Generator().manual_seed(seed)
    responses = torch.randint(0, vocab, (len(prompts), length), generator=g)
    batch = prompts.clone()
    batch.pop(tensor_keys=["input_ids", "attention_mask", "position_ids"])
    batch["input_ids"] = torch.cat([prompts["input_ids"], responses], 1)
    batch["attention_mask"] = torch.cat([prompts["attention_mask"], torch.ones_like(responses)], 1)
    batch["position_ids"] = extend_position_ids(prompts["position_ids"], length)
    batch["responses"] = responses
    return batch


def unpadded(batch: Batch, i: int) -> Batch:
    """Row ``i`` alone, with its left padding removed."""
    n = int(batch["attention_mask"][i].sum())
    return Batch.from_dict(
        {
            "input_ids": batch["input_ids"][i : i + 1, -n:],
            "attention_mask": batch["attention_mask"][i : i + 1, -n:],
            "position_ids": batch["position_ids"][i : i + 1, :, -n:],
            "responses": batch["responses"][i : i + 1],
        },
        {"multi_modal_inputs": batch["multi_modal_inputs"][i : i + 1]},
    )


@torch.no_grad()
def test_batched_log_probs_equal_per_sample_log_probs(setup):
    model, proc = setup
    batch = with_responses(mixed_prompts(proc))
    batched, _ = vlm_response_log_probs(model, batch)
    single = torch.cat(
        [vlm_response_log_probs(model, unpadded(batch, i))[0] for i in range(len(batch))]
    )
    assert batched.shape == (5, 6)
    torch.testing.assert_close(batched, single, atol=1e-5, rtol=0)
    # Micro-batches (how the actor splits) give the same numbers.
    micro = torch.cat([vlm_response_log_probs(model, mb)[0] for mb in batch.split(2)])
    torch.testing.assert_close(micro, batched, atol=1e-5, rtol=0)


@torch.no_grad()
def test_forward_matches_the_models_own_position_computation(setup):
    """With no position_ids the model computes mrope itself from token types; ours must agree."""
    model, proc = setup
    batch = mixed_prompts(proc)
    ours = vlm_forward_logits(model, batch)
    from mmrl.models.vlm import visual_model_inputs
    from mmrl.models.vlm_inputs import mm_token_type_ids

    model.model.rope_deltas = None
    theirs = model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        mm_token_type_ids=mm_token_type_ids(
            batch["input_ids"], proc.image_token_id, proc.video_token_id
        ),
        **visual_model_inputs(model, batch),
        use_cache=False,
    ).logits
    mask = batch["attention_mask"].bool()
    torch.testing.assert_close(ours[mask], theirs[mask], atol=1e-5, rtol=0)
    # Plain 1-D positions (the text-model layout) give different logits: the positions matter.
    flat = batch["attention_mask"].cumsum(-1) - 1
    wrong = batch.clone()
    wrong.pop(tensor_keys=["position_ids"])
    wrong["position_ids"] = flat.clamp(min=0).unsqueeze(1).expand(-1, 3, -1)
    assert (vlm_forward_logits(model, wrong)[mask] - ours[mask]).abs().max() > 1e-3


def test_mismatch_is_raised_before_the_model_runs(setup):
    model, proc = setup
    batch = mixed_prompts(proc)
    rows = batch["multi_modal_inputs"].copy()
    rows[0], rows[2] = rows[2], rows[0]
    batch.non_tensor["multi_modal_inputs"] = rows
    calls = []
    handle = model.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        with pytest.raises(
            VisionTokenMismatchError,
            match=r"sample 0: 6 image tokens in input_ids but \d+ image features",
        ):
            vlm_forward_logits(model, batch)
    finally:
        handle.remove()
    assert not calls


def test_generate_log_probs_match_training_recompute(setup):
    model, proc = setup
    prompts = mixed_prompts(proc).repeat(2)  # two rollouts per prompt
    sampling = SamplingParams(max_tokens=8, temperature=1.0, do_sample=True, seed=3)
    out = generate_vlm(model, prompts, sampling, proc.eos_token_id, proc.pad_token_id)
    P, T = prompts["input_ids"].shape[1], 8
    assert out["input_ids"].shape == (10, P + T) and out["position_ids"].shape == (10, 3, P + T)
    start = prompts["position_ids"].amax(dim=(1, 2)) + 1
    assert torch.equal(out["position_ids"][:, :, P], start[:, None].expand(-1, 3))
    assert out["multi_modal_inputs"][0] is prompts["multi_modal_inputs"][0]  # shared, not copied
    assert not torch.isin(out["responses"], torch.tensor(suppressed_token_ids(model))).any()
    with torch.no_grad():
        recomputed, entropy = vlm_response_log_probs(model, out, with_entropy=True)
    mask = out["response_mask"].bool()
    torch.testing.assert_close(recomputed[mask], out["rollout_log_probs"][mask], atol=1e-4, rtol=0)
    assert torch.isfinite(entropy).all()
    # A batch of text-only prompts goes through the same path.
    text_only = generate_vlm(model, prompts[1:2], sampling, proc.eos_token_id, proc.pad_token_id)
    with torch.no_grad():
        recomputed = vlm_response_log_probs(model, text_only)[0]
    mask = text_only["response_mask"].bool()
    torch.testing.assert_close(
        recomputed[mask], text_only["rollout_log_probs"][mask], atol=1e-4, rtol=0
    )


def test_sampled_vision_token_in_a_response_is_an_error(setup):
    model, proc = setup
    batch = with_responses(mixed_prompts(proc))
    batch["responses"][3, 2] = proc.image_token_id
    with pytest.raises(
        ValueError,
        match=rf"sample 3: response token 2 is the vision token id {proc.image_token_id}",
    ):
        vlm_response_log_probs(model, batch)


def test_qwen2_5_vl_video_positions_match_the_model(tmp_path):
    """Qwen2.5-VL spaces video frames in time (second_per_grid_ts); the processor must pass it
    on."""
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2_5_VLProcessor,
    )

    from mmrl.models.tiny_vlm import DEFAULT_TEXT, build_tiny_qwen2_vl_processor

    base = build_tiny_qwen2_vl_processor(56 * 56, 112 * 112)
    processor = Qwen2_5_VLProcessor(
        base.image_processor, base.tokenizer, base.video_processor, chat_template=base.chat_template
    )
    tok = processor.tokenizer
    ids = tok.convert_tokens_to_ids
    config = Qwen2_5_VLConfig(
        text_config={**DEFAULT_TEXT, "vocab_size": len(tok), "pad_token_id": tok.pad_token_id},
        vision_config={
            "depth": 1,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "out_hidden_size": 64,
            "fullatt_block_indexes": [0],
            "window_size": 56,
            "tokens_per_second": 2,
        },
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
    )
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(config)
    model.save_pretrained(tmp_path)
    processor.save_pretrained(tmp_path)
    proc = VisionProcessor.from_pretrained(
        tmp_path, DataConfig(max_prompt_length=64, video_fps=1.0)
    )
    assert type(proc.processor).__name__ == "Qwen2_5_VLProcessor"
    video = np.random.default_rng(0).integers(0, 255, (4, 56, 56, 3), dtype=np.uint8)
    batch = proc.encode(
        [
            VisionSample(chat_prompt(proc.processor, "<video>?"), videos=[video]),
            VisionSample(chat_prompt(proc.processor, "<image>!"), [image(56, 56, 0)]),
        ]
    )
    mm = batch["multi_modal_inputs"][0]
    assert mm["second_per_grid_ts"].tolist() == [2.0]  # temporal patch 2 / 1 fps
    from mmrl.models.vlm_inputs import collate_multi_modal, mm_token_type_ids

    collated = collate_multi_modal(batch["multi_modal_inputs"])
    expected, _ = model.model.get_rope_index(
        batch["input_ids"],
        mm_token_type_ids(batch["input_ids"], proc.image_token_id, proc.video_token_id),
        image_grid_thw=collated["image_grid_thw"],
        video_grid_thw=collated["video_grid_thw"],
        second_per_grid_ts=collated["second_per_grid_ts"],
        attention_mask=batch["attention_mask"],
    )
    assert torch.equal(batch["position_ids"], expected.transpose(0, 1))
    video_rows = batch["position_ids"][0, 0][batch["input_ids"][0] == proc.video_token_id]
    assert (
        video_rows.unique().numel() == 2 and int(video_rows.max() - video_rows.min()) == 4
    )  # 2 s * 2 tokens/s
    with torch.no_grad():
        single = vlm_forward_logits(model.eval(), batch[0:1])
        both = vlm_forward_logits(model, batch)
    torch.testing.assert_close(single[0], both[0], atol=1e-5, rtol=0)
