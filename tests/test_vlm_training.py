"""VLM batches in the training path: rollout bookkeeping, actor log-probs, frozen modules."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from mmrl.config import ActorConfig, DataConfig
from mmrl.hybrid import actor as actor_fns
from mmrl.models import get_family
from mmrl.models.freeze import freeze_modules
from mmrl.models.responses import finish_rollout
from mmrl.models.tiny_vlm import build_tiny_qwen2_vl
from mmrl.models.vlm import generate_vlm, vlm_response_log_probs
from mmrl.processors import VisionProcessor, VisionSample, chat_prompt
from mmrl.sampling import SamplingParams

VLM = get_family("vlm")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoModelForImageTextToText

    path = build_tiny_qwen2_vl(tmp_path_factory.mktemp("tiny_vlm"), seed=2)
    model = AutoModelForImageTextToText.from_pretrained(path, local_files_only=True)
    proc = VisionProcessor.from_pretrained(path, DataConfig(max_prompt_length=64))
    return model, proc


def prompts(proc: VisionProcessor, n: int = 1):
    """An image prompt, a two-image prompt and a text-only prompt, each repeated ``n`` times."""
    rng, p = np.random.default_rng(0), proc.processor

    def image(h, w):
        return Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8))

    batch = proc.encode(
        [
            VisionSample(chat_prompt(p, "<image>How many?"), [image(56, 84)]),
            VisionSample(chat_prompt(p, "<image><image>Same?"), [image(56, 56), image(112, 56)]),
            VisionSample(chat_prompt(p, "Just text")),
        ]
    )
    return batch.repeat(n, interleave=True)


def test_finish_rollout_extends_mrope_positions_and_shares_visual_inputs(setup):
    _, proc = setup
    batch = prompts(proc, n=4)
    responses = torch.tensor([[5, 6, 7, proc.eos_token_id, 9]] * len(batch))
    out = finish_rollout(
        batch, responses, torch.zeros(responses.shape), {proc.eos_token_id}, proc.pad_token_id
    )
    P, T = batch["input_ids"].shape[1], responses.shape[1]
    assert out["position_ids"].shape == (len(batch), 3, P + T)
    start = batch["position_ids"].amax(dim=(1, 2)) + 1
    assert torch.equal(
        out["position_ids"][:, :, P:],
        (start[:, None] + torch.arange(T)).unsqueeze(1).expand(-1, 3, -1),
    )
    assert out["response_mask"][0].tolist() == [1, 1, 1, 1, 0]
    # The n rollouts of a prompt and the prompt itself hold one processed copy of its pixels.
    mm = out["multi_modal_inputs"]
    assert all(mm[i] is batch["multi_modal_inputs"][i] for i in range(len(batch)))
    assert mm[0] is mm[3] and mm[0]["pixel_values"].data_ptr() == mm[1]["pixel_values"].data_ptr()


def test_hf_rollout_and_actor_agree_on_vlm_batches(setup):
    """generate -> the actor's recomputed log-probs, in micro-batches, equal the sampling
    log-probs."""
    from mmrl.rollout.module import ModuleRollout

    model, proc = setup
    model.eval()
    engine = ModuleRollout(model, VLM, proc.tokenizer)
    out = engine.generate(prompts(proc, n=2), SamplingParams(max_tokens=6, seed=3))
    assert out["position_ids"].shape[1] == 3 and "multi_modal_inputs" in out
    recomputed = actor_fns.compute_log_probs(VLM, model, out, micro_batch_size=2, temperature=1.0)
    mask = out["response_mask"].bool()
    assert torch.allclose(recomputed[mask], out["rollout_log_probs"][mask], atol=1e-4)
    whole, _ = vlm_response_log_probs(model, out)
    assert torch.allclose(recomputed, whole, atol=1e-5)


def test_freeze_modules_freezes_by_regex_and_the_update_leaves_them(setup):
    from transformers import AutoModelForImageTextToText

    _, proc = setup
    model = AutoModelForImageTextToText.from_config(setup[0].config)
    frozen = freeze_modules(model, [r"visual\."])
    assert frozen and all("visual." in name for name in frozen)
    assert all(p.requires_grad == ("visual." not in n) for n, p in model.named_parameters())
    with pytest.raises(ValueError, match="matches no parameter"):
        freeze_modules(model, ["no_such_module"])

    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    batch = generate_vlm(
        model,
        prompts(proc, n=2),
        SamplingParams(max_tokens=4, seed=0),
        proc.eos_token_id,
        proc.pad_token_id,
    )
    batch["old_log_probs"] = batch["rollout_log_probs"]
    batch["advantages"] = torch.randn(batch["response_mask"].shape)
    batch["valid_mask"] = torch.ones(len(batch), dtype=torch.bool)
    cfg = ActorConfig(use_kl_loss=False, ppo_micro_batch_size=2)
    actor_fns.update_policy(
        VLM, model, optimizer, batch, cfg, mini_batch_size=len(batch), temperature=1.0, seed=0
    )
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and not changed & set(frozen)
