"""The vLLM engine on interleaved world-model responses: it writes the known actions where
the hf engine does, with no log-prob and no loss, and samples the frames between them from
the same distribution. Importing vLLM takes ~10 s, so this is in the slow tier."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mmrl.config import RolloutConfig
from mmrl.hybrid.actor import compute_log_probs
from mmrl.models import get_family
from mmrl.processors.worldmodel import WorldModelPromptProcessor, load_windows
from mmrl.rollout.module import ModuleRollout
from mmrl.sampling import FORCED_KEY, SamplingParams
from mmrl.worldmodel.data import TrajectoryDataset, generate_dataset
from mmrl.worldmodel.token_lm import (
    TokenLMConfig,
    TokenWorldModelProcessor,
    build_token_world_model,
    save_token_world_model,
)
from mmrl.worldmodel.tokenizer import VQConfig, VQTokenizer, build_vq_model
from mmrl.worldmodel.vocab import VocabLayout, build_hf_tokenizer

pytestmark = pytest.mark.slow
TEXT_LM = get_family("text_lm")
LOGPROB_ATOL = 1e-4


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """``(actor, prompt processor, prompts, hf engine, vLLM engine)`` for a random tiny
    interleaved token world model (K=2, F=3) saved as the trainer saves it."""
    from mmrl.rollout.vllm import VLLMRollout

    data_dir = generate_dataset("push", 2, 6, tmp_path_factory.mktemp("push"), 0, progress=False)
    torch.manual_seed(0)
    tok = VQTokenizer(build_vq_model(VQConfig(codebook_size=16, block_out_channels=[8, 8, 8]), 32))
    layout = VocabLayout(16, tok.grid, TrajectoryDataset(data_dir).info.action)
    proc = TokenWorldModelProcessor(layout, context=2, future=3, action_form="interleaved")
    actor = build_token_world_model(
        proc, TokenLMConfig(64, 128, 2, 1, 1, max_position_embeddings=512)
    )
    path = tmp_path_factory.mktemp("wm")
    save_token_world_model(actor, proc, path)
    wm = WorldModelPromptProcessor(proc, tok)
    prompts = wm.encode_dataset(load_windows(TrajectoryDataset(data_dir), 2, 3), "train")
    hf = ModuleRollout(actor, TEXT_LM, build_hf_tokenizer(layout))
    vllm = VLLMRollout(
        model=actor,
        family=TEXT_LM,
        tokenizer=build_hf_tokenizer(layout),
        model_path=str(path),
        cfg=RolloutConfig(name="vllm", dtype="float32", kv_cache_memory_gib=0.125),
        max_model_len=proc.prompt_length + proc.response_length,
    )
    return actor, wm, prompts, hf, vllm


def test_vllm_writes_forced_actions_where_hf_does(engines):
    actor, wm, prompts, hf, vllm = engines
    greedy = SamplingParams(do_sample=False, **wm.sampling_overrides())
    got, expected = vllm.generate(prompts, greedy), hf.generate(prompts, greedy)
    forced = prompts[FORCED_KEY]
    steps = forced[0] >= 0
    assert steps.any() and torch.equal(got["responses"][:, steps], forced[:, steps])
    # the same frames, conditioned on the same actions
    assert torch.equal(got["responses"], expected["responses"])
    for out in (got, expected):
        assert (out["response_mask"][:, steps] == 0).all()
        assert (out["rollout_log_probs"][:, steps] == 0).all()
        assert (out["response_mask"][:, ~steps] == 1).all()
    mask = got["response_mask"].bool()
    torch.testing.assert_close(
        got["rollout_log_probs"][mask],
        expected["rollout_log_probs"][mask],
        atol=LOGPROB_ATOL,
        rtol=0,
    )
    assert got.meta["rollout_tokens"] == int(mask.sum())  # forced steps are not sampled


def test_vllm_sampled_log_probs_match_the_actor_on_sampled_tokens(engines):
    actor, wm, prompts, hf, vllm = engines
    sampling = SamplingParams(temperature=1.2, seed=5, **wm.sampling_overrides())
    got = vllm.generate(prompts, sampling)
    steps = prompts[FORCED_KEY][0] >= 0
    assert torch.equal(got["responses"][:, steps], prompts[FORCED_KEY][:, steps])
    assert (got["rollout_log_probs"][:, steps] == 0).all()
    recomputed = compute_log_probs(TEXT_LM, actor, got, micro_batch_size=8, temperature=1.2)
    mask = got["response_mask"].bool()
    torch.testing.assert_close(
        recomputed[mask], got["rollout_log_probs"][mask], atol=LOGPROB_ATOL, rtol=0
    )
    again = vllm.generate(prompts, sampling)  # seeded per row and per run of free steps
    assert torch.equal(again["responses"], got["responses"])
    other = vllm.generate(prompts, dataclasses.replace(sampling, seed=6))
    assert not torch.equal(other["responses"], got["responses"])
    assert not wm.decode(got)["pred_frames"].isnan().any()
