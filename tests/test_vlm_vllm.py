"""vLLM rollout of a tiny Qwen2-VL built from config: its sampling log-probs must be the
training actor's recomputed log-probs, before and after an in-place weight sync, for
prompts with images, several images, video, an image and a video, and text only.

Importing vLLM takes ~10 s and building the engine ~20 s, so these tests are slow.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from mmrl.config import DataConfig
from mmrl.hybrid import actor as actor_fns
from mmrl.models import get_family
from mmrl.models.tiny_vlm import build_tiny_qwen2_vl
from mmrl.processors import VisionProcessor, VisionSample, chat_prompt
from mmrl.sampling import SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from transformers import AutoModelForImageTextToText

    from mmrl.config import RolloutConfig
    from mmrl.rollout.vllm import VLLMRollout

    path = build_tiny_qwen2_vl(tmp_path_factory.mktemp("tiny_vlm"), seed=3)
    actor = AutoModelForImageTextToText.from_pretrained(path, local_files_only=True).eval()
    proc = VisionProcessor.from_pretrained(
        path, DataConfig(max_prompt_length=64, keep_raw_media=True)
    )
    cfg = RolloutConfig(name="vllm", dtype="float32", kv_cache_memory_gib=0.125)
    rollout = VLLMRollout(
        model=actor,
        family=get_family("vlm"),
        tokenizer=proc.tokenizer,
        model_path=str(path),
        cfg=cfg,
        max_model_len=96,
    )
    return actor, proc, rollout


def prompts(proc: VisionProcessor):
    rng, p = np.random.default_rng(0), proc.processor

    def image(h, w):
        return Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8))

    png = image(112, 112)
    return proc.encode(
        [
            VisionSample(chat_prompt(p, "<image>How many?"), [image(56, 84)]),
            VisionSample(chat_prompt(p, "<image><image>Same?"), [png, image(112, 56)]),
            VisionSample(chat_prompt(p, "Just text")),
            VisionSample(
                chat_prompt(p, "<video>What moves?"),
                videos=[rng.integers(0, 255, (4, 56, 84, 3), dtype=np.uint8)],
            ),
            VisionSample(
                chat_prompt(p, "<image>then<video>"),
                [image(56, 56)],
                [rng.integers(0, 255, (2, 56, 56, 3), dtype=np.uint8)],
            ),
        ]
    ).repeat(2, interleave=True)


def assert_actor_agrees(actor, rollout, batch, seed: int) -> None:
    out = rollout.generate(batch, SamplingParams(max_tokens=8, seed=seed))
    assert out["position_ids"].shape[1] == 3
    # The vision ids travel as a short suppressed list, not as the vocabulary minus them.
    support = out.meta["sampling_support"]
    assert support["allowed_token_ids"] is None and len(support["suppressed_token_ids"]) <= 8
    recomputed = actor_fns.compute_log_probs(
        get_family("vlm"), actor, out, micro_batch_size=4, temperature=1.0
    )
    mask = out["response_mask"].bool()
    diff = (recomputed - out["rollout_log_probs"]).abs()[mask]
    assert diff.max() < 1e-4, f"vLLM and actor log-probs differ by up to {diff.max():.2e}"


def test_vllm_log_probs_match_the_actor(engine):
    actor, proc, rollout = engine
    assert_actor_agrees(actor, rollout, prompts(proc), seed=0)


def test_vllm_log_probs_match_after_weight_sync(engine):
    actor, proc, rollout = engine
    with torch.no_grad():
        g = torch.Generator().manual_seed(0)
        for p in actor.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    rollout.sync_weights(actor)
    assert_actor_agrees(actor, rollout, prompts(proc), seed=1)


def test_vllm_needs_the_raw_images(engine):
    _, proc, rollout = engine
    batch = prompts(proc)
    batch.pop(non_tensor_keys=["multi_modal_data"])
    with pytest.raises(ValueError, match="keep_raw_media"):
        rollout.generate(batch, SamplingParams(max_tokens=4))
