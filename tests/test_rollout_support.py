"""Constrained sampling: training recomputes log-probs under the support the rollout sampled from.

A world model samples visual tokens only, in responses of a fixed length. Its
rollout log-probs are normalised over those tokens; a training forward over the
whole vocabulary would disagree on every step, and the PPO ratio and KL would then
compare two different distributions.
"""

from __future__ import annotations

import torch

from mmrl.hybrid.actor import compute_log_probs
from mmrl.models import get_family
from mmrl.processors import TextProcessor
from mmrl.rollout.module import ModuleRollout
from mmrl.sampling import SUPPORT_KEY, SamplingParams, restrict_logits
from tests.conftest import save_tiny_qwen2


def test_recomputed_log_probs_use_the_sampled_support(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = save_tiny_qwen2(tmp_path / "lm", tied=False, seed=1)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    prompts = TextProcessor(tokenizer, max_prompt_length=8).encode_prompts(["12+34=", "1+2=", "7="])
    digits = tuple(tokenizer.convert_tokens_to_ids(list("0123")))
    sampling = SamplingParams(
        max_tokens=6, temperature=0.7, seed=0, allowed_token_ids=digits, min_tokens=4
    )
    out = ModuleRollout(model, get_family("text_lm"), tokenizer).generate(prompts, sampling)
    mask = out["response_mask"].bool()
    assert set(out["responses"][mask].tolist()) <= {*digits, tokenizer.eos_token_id}
    assert out.meta[SUPPORT_KEY]["min_tokens"] == 4

    recomputed = compute_log_probs(
        get_family("text_lm"), model, out, micro_batch_size=2, temperature=0.7
    )
    assert (recomputed - out["rollout_log_probs"]).abs()[mask].max() < 1e-5
    # Over the whole vocabulary they would not agree: the restriction is what matches them.
    out.meta[SUPPORT_KEY] = None
    unrestricted = compute_log_probs(
        get_family("text_lm"), model, out, micro_batch_size=2, temperature=0.7
    )
    assert (unrestricted - out["rollout_log_probs"]).abs()[mask].min() > 1e-2


def test_restrict_logits_masks_stops_only_before_min_tokens():
    logits = torch.zeros(1, 3, 5)
    support = {"allowed_token_ids": [1, 2, 4], "stop_token_ids": [4], "min_tokens": 2}
    out = restrict_logits(logits, support)
    low = torch.finfo(torch.float32).min
    assert torch.equal(out[0, :, 0], torch.full((3,), low)) and torch.equal(
        out[0, :, 3], torch.full((3,), low)
    )
    assert (
        out[0, 0, 4] == low and out[0, 1, 4] == low and out[0, 2, 4] == 0
    )  # stop allowed from step 2
    assert torch.isfinite(torch.log_softmax(out, -1)[..., [1, 2]]).all()
    assert restrict_logits(logits, None) is logits


def test_restrict_logits_masks_suppressed_ids_everywhere():
    logits = torch.zeros(2, 3, 5)
    support = {
        "allowed_token_ids": None,
        "suppressed_token_ids": [0, 3],
        "stop_token_ids": [4],
        "min_tokens": 0,
    }
    out = restrict_logits(logits, support)
    assert (out[..., [0, 3]] == torch.finfo(torch.float32).min).all() and (
        out[..., [1, 2, 4]] == 0
    ).all()
