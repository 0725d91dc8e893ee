"""The vLLM rollout engine against the transformers engine and the training forward.

Engines run in fp32, like the actor, so both sides compute the same function and
differ only by kernel rounding (oneDNN GEMMs and paged attention against torch
matmuls): per-token log-probs agree to ~1e-5, and the tests allow 1e-4.
Importing vLLM alone takes ~10 s, so every test here is in the slow tier.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from mmrl.config import RolloutConfig, load_config
from mmrl.hybrid.actor import compute_log_probs
from mmrl.models import get_family
from mmrl.models.text_lm import MODEL_INPUTS
from mmrl.processors import TextProcessor
from mmrl.protocol import Batch
from mmrl.rollout.module import ModuleRollout
from mmrl.sampling import SamplingParams
from mmrl.trainer.fit import fit
from tests.conftest import assert_rollout_matches_actor, run_overrides

TEXT_LM = get_family("text_lm")

pytestmark = pytest.mark.slow
LOGPROB_ATOL = 1e-4
PROMPTS = ["12+34=", "1+2=", "49+49=", "7=", "30-4=", "8*8=", "0+0=", "25+17="]


def encode(tokenizer, prompts: list[str] = PROMPTS) -> Batch:
    return TextProcessor(tokenizer, max_prompt_length=8).encode_prompts(prompts)


@torch.no_grad()
def reinit(model: torch.nn.Module, seed: int) -> None:
    """Replace every weight with a fresh random draw (norm scales around 1)."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        p.copy_(0.2 * torch.randn(p.shape, generator=gen) + (1.0 if "norm" in name else 0.0))


@pytest.fixture(scope="module")
def compiled_rollout(tiny_lm_dirs):
    """``(actor, tokenizer, engine)``: a compiled fp32 engine (``enforce_eager=false``, what
    runs of 200 steps or more get by default) of the tied tiny model, beside an actor of its
    own. Module-scoped because shutting a vLLM engine down mid-module tears down the parallel
    state that the session's engines share."""
    from mmrl.rollout.vllm import VLLMRollout

    path = tiny_lm_dirs["tied"]
    actor = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    cfg = RolloutConfig(
        name="vllm", dtype="float32", kv_cache_memory_gib=0.0625, enforce_eager=False
    )
    return actor, tokenizer, VLLMRollout(actor, TEXT_LM, tokenizer, str(path), cfg, 64)


@pytest.mark.parametrize(
    ("kind", "source"),
    [("untied", "module"), ("tied", "module"), ("tied", "state_dict"), ("compiled", "module")],
)
def test_sync_matches_transformers(request, vllm_rollouts, kind, source):
    """After an in-place sync, greedy tokens and log-probs equal the transformers engine's.

    ``module`` streams ``named_parameters()``, where a tied model has no
    ``lm_head.weight``: the path on which vLLM's tied lm_head used to stay stale.
    ``compiled``: the sync reaches a compiled graph too.
    """
    if kind == "compiled":
        actor, tokenizer, engine = request.getfixturevalue("compiled_rollout")
    else:
        actor, tokenizer, engine = vllm_rollouts[kind]
    prompts, greedy = encode(tokenizer), SamplingParams(max_tokens=12, do_sample=False)
    reinit(actor, seed=len(kind) + len(source))
    expected = ModuleRollout(actor, TEXT_LM, tokenizer).generate(prompts, greedy)
    stale = engine.generate(prompts, greedy)
    assert not torch.equal(stale["responses"], expected["responses"]), (
        "perturbation too small to test the sync"
    )

    engine.sync_weights(actor if source == "module" else actor.state_dict().items())
    got = engine.generate(prompts, greedy)
    assert torch.equal(got["responses"], expected["responses"])
    assert torch.equal(got["response_mask"], expected["response_mask"])
    torch.testing.assert_close(
        got["rollout_log_probs"], expected["rollout_log_probs"], atol=LOGPROB_ATOL, rtol=0
    )
    assert torch.equal(got["input_ids"], expected["input_ids"])
    assert torch.equal(got["position_ids"], expected["position_ids"])
    assert got.meta["rollout_tokens"] == int(got["response_mask"].sum())
    assert got.meta["rollout_time_s"] > 0


def test_constraints_match_transformers(vllm_rollouts):
    """``allowed_token_ids`` and ``min_tokens`` shape the distribution before sampling in both
    engines.
    """
    actor, tokenizer, engine = vllm_rollouts["untied"]
    reinit(actor, seed=3)
    engine.sync_weights(actor)
    digits = tuple(tokenizer.convert_tokens_to_ids(list("0123456789")))
    sampling = SamplingParams(max_tokens=8, do_sample=False, allowed_token_ids=digits, min_tokens=3)
    prompts = encode(tokenizer)
    got = engine.generate(prompts, sampling)
    expected = ModuleRollout(actor, TEXT_LM, tokenizer).generate(prompts, sampling)
    assert torch.equal(got["responses"], expected["responses"])
    mask = got["response_mask"].bool()  # ModuleRollout's padded steps can hold -inf * 0 = nan
    torch.testing.assert_close(
        got["rollout_log_probs"][mask],
        expected["rollout_log_probs"][mask],
        atol=LOGPROB_ATOL,
        rtol=0,
    )
    valid = got["responses"][mask]
    assert set(valid.tolist()) <= {*digits, tokenizer.eos_token_id}
    assert (got["response_mask"].sum(-1) >= 3).all()
    # Training recomputes them under the same restriction (recorded in the batch's meta).
    recomputed = compute_log_probs(TEXT_LM, actor, got, micro_batch_size=8, temperature=1.0)
    torch.testing.assert_close(
        recomputed[mask], got["rollout_log_probs"][mask], atol=LOGPROB_ATOL, rtol=0
    )


def reference_log_probs(
    model: torch.nn.Module, batch: Batch, temperature: float, top_k: int
) -> torch.Tensor:
    """log-softmax [B, T] of the tempered logits restricted to the ``top_k`` largest."""
    T = batch["responses"].shape[1]
    with torch.no_grad():
        logits = model(**{k: batch[k] for k in MODEL_INPUTS}).logits[:, -T - 1 : -1] / temperature
    kth = logits.topk(top_k, dim=-1).values[..., -1:]
    logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.log_softmax(logits, -1).gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)


def test_sampled_log_probs_are_those_of_the_sampling_distribution(vllm_rollouts):
    """With temperature 0.7 the rollout log-probs equal the training path's recomputation;
    with top-k they are those of the truncated distribution; seeds make samples repeat."""
    actor, tokenizer, engine = vllm_rollouts["untied"]
    reinit(actor, seed=7)
    engine.sync_weights(actor)
    prompts = encode(tokenizer).repeat(4, interleave=True)

    sampling = SamplingParams(max_tokens=12, temperature=0.7, seed=11)
    out = engine.generate(prompts, sampling)
    mask = out["response_mask"]
    recomputed = compute_log_probs(TEXT_LM, actor, out, micro_batch_size=64, temperature=0.7)
    torch.testing.assert_close(
        out["rollout_log_probs"], recomputed * mask, atol=LOGPROB_ATOL, rtol=0
    )
    assert len({tuple(r) for r in out["responses"].tolist()}) > len(PROMPTS), (
        "rows of one prompt should differ"
    )
    assert torch.equal(engine.generate(prompts, sampling)["responses"], out["responses"])
    other_seed = engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0.7, seed=12))
    assert not torch.equal(other_seed["responses"], out["responses"])

    top_k = engine.generate(
        prompts, SamplingParams(max_tokens=12, temperature=0.7, top_k=3, seed=11)
    )
    mask = top_k["response_mask"]
    expected = reference_log_probs(actor, top_k, temperature=0.7, top_k=3).where(mask.bool(), 0.0)
    torch.testing.assert_close(top_k["rollout_log_probs"], expected, atol=LOGPROB_ATOL, rtol=0)
    untruncated = (
        compute_log_probs(TEXT_LM, actor, top_k, micro_batch_size=64, temperature=0.7) * mask
    )
    assert (top_k["rollout_log_probs"] - untruncated).abs().max() > 1e-2


def test_overlong_prompt_names_the_sample(vllm_rollouts):
    _, tokenizer, engine = vllm_rollouts["untied"]
    prompts = encode(tokenizer, ["1=", "2=", "12+34=", "3="])  # 2, 2, 6, 2 tokens
    with pytest.raises(
        ValueError, match=r"sample 2: prompt has 6 tokens.*max_model_len=64.*max_tokens=60"
    ):
        engine.generate(prompts, SamplingParams(max_tokens=60, do_sample=False))


def test_grpo_with_vllm_rollout_learns(tmp_path, warm_model_dir):
    """A short GRPO run sampling with vLLM: rollout and training log-probs agree, and
    held-out reward rises as with the transformers engine.

    Validation is greedy, so its score moves only with the weights; with the shared
    SFT warm-up it rose by ~0.13 in 20 steps (sampled validation is noisier).
    """
    cfg = load_config(
        run_overrides(
            tmp_path,
            f"actor_rollout_ref.model.path={warm_model_dir}",
            "actor_rollout_ref.rollout.name=vllm",
            "actor_rollout_ref.rollout.kv_cache_memory_gib=0.125",
            "actor_rollout_ref.rollout.val_kwargs.do_sample=false",
            "trainer.total_steps=20",
            "trainer.test_freq=10",
        )
    )
    result = fit(cfg)
    val = result.series("val/score/mean")
    assert len(val) == 3
    assert np.mean(val[-2:]) > val[0] + 0.05, f"held-out score did not rise: {val}"
    # A bf16 vLLM engine also rounds its logits to bf16 before the log-softmax: measured mean
    # gap 0.008-0.02 per step here (largest token 0.38), against 2e-3 for the transformers
    # engine.
    assert_rollout_matches_actor(result.series, cfg.trainer.mixed_precision, bf16_mean_gap=0.05)
    assert len(result.series("timing_s/update_weights")) == 20
    assert min(result.series("perf/rollout_tokens_per_s")) > 0

    # The exported actor is one save_pretrained folder that both engines serve alike.
    from mmrl.rollout.vllm import VLLMRollout

    exported = result.output_dir / "actor"
    actor = AutoModelForCausalLM.from_pretrained(exported, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(exported, local_files_only=True)
    rollout_cfg = RolloutConfig(name="vllm", dtype="float32", kv_cache_memory_gib=0.0625)
    engine = VLLMRollout(
        model=None,
        family=TEXT_LM,
        tokenizer=tokenizer,
        model_path=str(exported),
        cfg=rollout_cfg,
        max_model_len=32,
    )
    greedy = SamplingParams(max_tokens=4, do_sample=False)
    prompts = encode(tokenizer)
    from_vllm = engine.generate(prompts, greedy)
    from_hf = ModuleRollout(actor, TEXT_LM, tokenizer).generate(prompts, greedy)
    assert torch.equal(from_vllm["responses"], from_hf["responses"])
