"""The VLM processor: tokens, mrope positions, visual inputs, limits, errors and the cache."""

from __future__ import annotations

import gc
import io
import weakref

import numpy as np
import pytest
import torch
from PIL import Image

from mmrl.config import DataConfig
from mmrl.models.tiny_vlm import build_tiny_qwen2_vl
from mmrl.models.vlm_inputs import (
    VisionTokenMismatchError,
    check_vision_tokens,
    collate_multi_modal,
    extend_position_ids,
    mm_token_type_ids,
    split_multi_modal,
)
from mmrl.processors import PromptTooLongError, VisionProcessor, VisionSample, chat_prompt
from mmrl.processors.media import read_video
from mmrl.protocol import Batch


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_qwen2_vl(tmp_path_factory.mktemp("tiny_vlm"))


@pytest.fixture(scope="module")
def tiny_model(tiny_dir):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(tiny_dir, local_files_only=True).eval()


def make_processor(tiny_dir, **overrides) -> VisionProcessor:
    return VisionProcessor.from_pretrained(
        tiny_dir, DataConfig(**{"max_prompt_length": 96, **overrides})
    )


def image(h: int, w: int, seed: int = 0) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8))


def png_bytes(h: int, w: int, seed: int = 0) -> bytes:
    buf = io.BytesIO()
    image(h, w, seed).save(buf, format="PNG")
    return buf.getvalue()


def write_mp4(path, frames: int = 30, fps: float = 10.0, size=(64, 48)):
    import cv2

    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), fps, size)
    for i in range(frames):
        frame = np.zeros((size[1], size[0], 3), np.uint8)
        frame[:, (2 * i) % size[0] :][:, :8] = 255
        writer.write(frame)
    writer.release()
    return path


def mixed_samples(proc: VisionProcessor, video) -> list[VisionSample]:
    """Image, text-only, two images, video, and image + video."""
    p = proc.processor
    return [
        VisionSample(chat_prompt(p, "<image>How many?"), [image(60, 90)]),
        VisionSample(chat_prompt(p, "Just text")),
        VisionSample(
            chat_prompt(p, "<image> vs <image>: which is larger?"),
            [png_bytes(112, 112, 1), image(40, 80, 2)],
        ),
        VisionSample(chat_prompt(p, "<video>What moves?"), videos=[video]),
        VisionSample(chat_prompt(p, "<image><video>Both"), [image(56, 56, 3)], [video]),
    ]


@pytest.fixture(scope="module")
def video_path(tmp_path_factory):
    return write_mp4(tmp_path_factory.mktemp("video") / "clip.mp4")


def test_tiny_model_and_processor_reload_with_auto_classes(tiny_dir, tiny_model):
    from transformers import AutoProcessor, Qwen2VLForConditionalGeneration, Qwen2VLVideoProcessor

    processor = AutoProcessor.from_pretrained(tiny_dir, local_files_only=True)
    assert isinstance(processor.video_processor, Qwen2VLVideoProcessor)
    assert isinstance(tiny_model, Qwen2VLForConditionalGeneration)
    tok = processor.tokenizer
    for name in ("<|vision_start|>", "<|image_pad|>", "<|video_pad|>", "<|vision_end|>"):
        assert tok.convert_tokens_to_ids(name) != tok.unk_token_id
    assert tiny_model.config.image_token_id == tok.convert_tokens_to_ids("<|image_pad|>")
    assert (
        tiny_model.config.text_config.hidden_size
        // tiny_model.config.text_config.num_attention_heads
        == 64
    )
    text = chat_prompt(processor, "<image>Count")
    assert text.startswith("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Count")
    assert text.endswith("<|im_start|>assistant\n")


def test_encode_mixed_batch_layout_and_model_rope_index(tiny_dir, tiny_model, video_path):
    proc = make_processor(tiny_dir)
    batch = proc.encode(mixed_samples(proc, str(video_path)))
    B, P = 5, 96
    assert batch["input_ids"].shape == (B, P) and batch["position_ids"].shape == (B, 3, P)
    mask = batch["attention_mask"]
    assert (mask[:, -1] == 1).all() and (mask[:, 0] == 0).all()  # left-padded
    assert (batch["input_ids"][mask == 0] == proc.pad_token_id).all()
    # The positions are the model's own, computed on the padded batch in one call.
    types = mm_token_type_ids(batch["input_ids"], proc.image_token_id, proc.video_token_id)
    mm = collate_multi_modal(batch["multi_modal_inputs"])
    expected, _ = tiny_model.model.get_rope_index(
        batch["input_ids"],
        mm_token_type_ids=types,
        image_grid_thw=mm["image_grid_thw"],
        video_grid_thw=mm["video_grid_thw"],
        attention_mask=mask,
    )
    assert torch.equal(batch["position_ids"], expected.transpose(0, 1))
    # Vision tokens get 3-D positions: the rows differ inside an image, not in text.
    row0 = batch["position_ids"][0][:, mask[0].bool()]
    is_image = batch["input_ids"][0][mask[0].bool()] == proc.image_token_id
    assert not torch.equal(row0[1, is_image], row0[2, is_image])
    assert torch.equal(row0[0, ~is_image], row0[1, ~is_image])
    assert mm["num_images"].tolist() == [1, 0, 2, 0, 1] and mm["num_videos"].tolist() == [
        0,
        0,
        0,
        1,
        1,
    ]
    assert batch.non_tensor["multi_modal_inputs"][1] == {}
    assert batch.meta == {"num_filtered_prompts": 0, "num_truncated_prompts": 0}


def test_video_is_sampled_to_fps_and_frame_limits(tiny_dir, video_path):
    frames, meta = read_video(str(video_path), fps=2.0, min_frames=2, max_frames=16)
    assert frames.shape == (6, 48, 64, 3) and frames.dtype == np.uint8  # 3 s at 2 fps
    assert meta.frames_indices[0] == 0 and meta.frames_indices[-1] == 29
    assert read_video(str(video_path), 2.0, 2, 4)[0].shape[0] == 4
    assert read_video(video_path.read_bytes(), 1.0, 2, 16)[0].shape[0] == 2  # bytes work too
    proc = make_processor(tiny_dir, video_fps=2.0, video_max_frames=4)
    out = proc.process(
        VisionSample(chat_prompt(proc.processor, "<video>?"), videos=[str(video_path)])
    )
    assert out.multi_modal_inputs["video_grid_thw"][0, 0] == 2  # 4 frames / temporal patch 2


def test_pixel_limits_bound_vision_tokens(tiny_dir):
    def n_tokens(**limits) -> int:
        proc = make_processor(tiny_dir, **limits)
        out = proc.process(VisionSample(chat_prompt(proc.processor, "<image>"), [image(224, 224)]))
        return int((out.input_ids == proc.image_token_id).sum())

    assert n_tokens() == 16  # the saved processor's max_pixels = 112 * 112 -> 8x8 patches
    assert n_tokens(max_pixels=56 * 56) == 4
    assert n_tokens(min_pixels=168 * 168, max_pixels=168 * 168) == 36


def test_truncation_drops_text_never_vision_tokens(tiny_dir):
    proc = make_processor(tiny_dir, max_prompt_length=40, truncation="left")
    long_text = "word " * 20
    sample = VisionSample(
        chat_prompt(proc.processor, f"{long_text}<image>{long_text}"), [image(112, 112)]
    )
    full = make_processor(tiny_dir, max_prompt_length=400).process(sample).input_ids
    batch = proc.encode([sample])
    ids = batch["input_ids"][0]
    assert len(full) > 40 and int(batch["attention_mask"].sum()) == 40
    assert (ids == proc.image_token_id).sum() == (full == proc.image_token_id).sum() == 16
    for token in ("<|vision_start|>", "<|vision_end|>", "<|im_start|>", "<|im_end|>"):
        tid = proc.tokenizer.convert_tokens_to_ids(token)
        assert (ids == tid).sum() == (full == tid).sum()
    # Left truncation keeps the end of the prompt (the generation prompt).
    assert torch.equal(ids[-10:], full[-10:])
    assert batch.meta["num_truncated_prompts"] == 1


def test_prompt_whose_vision_tokens_do_not_fit_errors_or_is_filtered(tiny_dir):
    def sample(p: VisionProcessor) -> VisionSample:  # 2 x 16 vision tokens: more than 30 alone
        return VisionSample(
            chat_prompt(p.processor, "<image><image>two"), [image(112, 112), image(112, 112)]
        )

    proc = make_processor(tiny_dir, max_prompt_length=30, truncation="left")
    with pytest.raises(
        PromptTooLongError, match=r"sample 0: prompt has \d+ tokens \(32 of them vision tokens\)"
    ):
        proc.encode([sample(proc)])
    proc = make_processor(tiny_dir, max_prompt_length=30, filter_overlong_prompts=True)
    short = VisionSample(chat_prompt(proc.processor, "hi"))
    batch = proc.encode([sample(proc), short, sample(proc)])
    assert len(batch) == 1 and batch.meta["num_filtered_prompts"] == 2
    assert batch["raw_prompt"][0] == short.prompt


def test_placeholder_count_must_match_media(tiny_dir):
    proc = make_processor(tiny_dir)
    with pytest.raises(
        ValueError, match=r"sample 7: prompt has 1 <\|image_pad\|> placeholders but 2 images"
    ):
        proc.encode(
            [VisionSample(chat_prompt(proc.processor, "<image>"), [image(56, 56), image(56, 56)])],
            sample_ids=[7],
        )


def test_token_feature_mismatch_is_caught_with_sample_numbers_and_cause(tiny_dir):
    proc = make_processor(tiny_dir)
    batch = proc.encode(
        [
            VisionSample(chat_prompt(proc.processor, "<image>a"), [image(112, 112)]),
            VisionSample(chat_prompt(proc.processor, "<image>b"), [image(56, 56)]),
        ]
    )
    rows = list(batch["multi_modal_inputs"])
    args = (proc.image_token_id, proc.video_token_id, proc.merge_size)
    check_vision_tokens(batch["input_ids"], rows, *args)  # consistent
    with pytest.raises(
        VisionTokenMismatchError,
        match=r"sample 1: 4 image tokens in input_ids but 16 image features",
    ):
        check_vision_tokens(batch["input_ids"], [rows[0], rows[0]], *args)  # features swapped
    cut = batch["input_ids"].clone()
    cut[0, cut[0] == proc.image_token_id] = proc.pad_token_id
    cut[0, -3] = proc.image_token_id
    with pytest.raises(VisionTokenMismatchError, match="truncated through its vision tokens"):
        check_vision_tokens(cut, rows, *args)
    bad = dict(rows[1], pixel_values=rows[1]["pixel_values"][:-1])
    with pytest.raises(
        VisionTokenMismatchError, match="pixel_values has 15 rows but image_grid_thw implies 16"
    ):
        check_vision_tokens(batch["input_ids"], [rows[0], bad], *args)


def test_collate_and_split_round_trip_over_micro_batches(tiny_dir, video_path):
    proc = make_processor(tiny_dir)
    batch = proc.encode(mixed_samples(proc, str(video_path)))
    rows = list(batch["multi_modal_inputs"])
    full = collate_multi_modal(rows)
    n_patches = sum(int(r["image_grid_thw"].prod(-1).sum()) for r in rows if "image_grid_thw" in r)
    assert full["pixel_values"].shape[0] == n_patches and full["image_grid_thw"].shape == (4, 3)
    back = split_multi_modal(full)
    assert [sorted(r) for r in back] == [sorted(r) for r in rows]
    for a, b in zip(back, rows, strict=True):
        assert all(torch.equal(a[k], b[k]) for k in a)
    # Micro-batches of the Batch collate to consecutive pieces of the full collation.
    parts = [collate_multi_modal(mb["multi_modal_inputs"]) for mb in batch.split(2)]
    assert torch.equal(
        torch.cat([p["pixel_values"] for p in parts if "pixel_values" in p]), full["pixel_values"]
    )
    assert torch.equal(torch.cat([p["num_images"] for p in parts]), full["num_images"])


def test_extend_position_ids_continues_after_the_largest_prompt_position():
    pos = torch.tensor([[[0, 0, 1, 2, 2, 4], [0, 0, 1, 2, 3, 4], [0, 0, 1, 3, 2, 4]]])  # [1, 3, 6]
    out = extend_position_ids(pos, 3)
    assert out.shape == (1, 3, 9) and torch.equal(out[0, :, 6:], torch.tensor([[5, 6, 7]] * 3))
    big_video = torch.tensor([[[0, 9, 3]] * 3])
    assert extend_position_ids(big_video, 2)[0, :, 3:].tolist() == [[10, 11]] * 3
    assert extend_position_ids(torch.tensor([[0, 0, 1, 2]]), 2).tolist() == [[0, 0, 1, 2, 3, 4]]


def test_cache_shares_one_processed_copy_per_prompt(tiny_dir):
    proc = make_processor(tiny_dir)
    prompt = chat_prompt(proc.processor, "<image>count")
    data = png_bytes(112, 112)
    batch = proc.encode(
        [VisionSample(prompt, [data]) for _ in range(4)]
        + [VisionSample(prompt, [png_bytes(112, 112, 9)])]
    )
    mm = batch["multi_modal_inputs"]
    assert all(mm[i] is mm[0] for i in range(4)) and mm[4] is not mm[0]
    assert proc.cache_info()["hits"] == 3 and proc.cache_info()["misses"] == 2
    assert proc.cache_info()["bytes"] >= 2 * mm[0]["pixel_values"].numel() * 4
    # Repeating the Batch (n rollouts) shares the same objects too.
    assert batch.repeat(8)["multi_modal_inputs"][7] is mm[0]
    nocache = make_processor(tiny_dir, cache_size=0)
    again = nocache.encode([VisionSample(prompt, [data]) for _ in range(2)])["multi_modal_inputs"]
    assert again[0] is not again[1] and torch.equal(again[0]["pixel_values"], mm[0]["pixel_values"])
    keyed = make_processor(tiny_dir)
    keyed.encode(
        [VisionSample(prompt, [data], key="train/0"), VisionSample(prompt, [data], key="train/0")]
    )
    assert keyed.cache_info()["hits"] == 1


@pytest.mark.parametrize("keep", [False, True])
def test_raw_media_is_dropped_unless_kept(tiny_dir, keep):
    proc = make_processor(tiny_dir, keep_raw_media=keep)
    img = image(112, 112)
    ref = weakref.ref(img)
    batch = proc.encode([VisionSample(chat_prompt(proc.processor, "<image>"), [img])])
    del img
    gc.collect()
    assert (ref() is not None) == keep
    assert ("multi_modal_data" in batch) == keep


def test_batch_with_visual_inputs_saves_and_loads(tiny_dir, tmp_path):
    proc = make_processor(tiny_dir)
    batch = proc.encode(
        [
            VisionSample(chat_prompt(proc.processor, "<image>a"), [image(56, 56)]),
            VisionSample(chat_prompt(proc.processor, "b")),
        ]
    )
    batch.save(tmp_path / "b")
    loaded = Batch.load(tmp_path / "b")
    assert torch.equal(loaded["position_ids"], batch["position_ids"])
    assert torch.equal(
        loaded["multi_modal_inputs"][0]["pixel_values"],
        batch["multi_modal_inputs"][0]["pixel_values"],
    )
