"""The transformers engine's sampling loop: what ``generate`` samples, without computing the rows
that have stopped (docs/scaling.md)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import LogitsProcessorList

from mmrl.models import get_family
from mmrl.models.decode import decode_rows
from mmrl.models.kv_cache import LONG_SEQUENCE
from mmrl.models.text_lm import transformers_generate
from mmrl.processors import TextProcessor
from mmrl.rollout.module import ModuleRollout
from mmrl.sampling import SEEDS_KEY, SamplingParams, row_seeds
from tests.conftest import save_tiny_qwen2

PROMPTS = ["12+34=", "1+2=", "7=", "40+2=", "3+3=", "99+1=", "5+5=", "0="]


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = save_tiny_qwen2(tmp_path_factory.mktemp("decode") / "lm", tied=False, seed=3)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    prompts = TextProcessor(tokenizer, max_prompt_length=8).encode_prompts(PROMPTS).repeat(2)
    prompts[SEEDS_KEY] = row_seeds(7, len(prompts))
    return model, tokenizer, prompts


def rollout(lm, sampling: SamplingParams, drops_finished_rows: bool):
    model, tokenizer, prompts = lm
    family = type(get_family("text_lm"))()  # its own instance: the registry's stays as it is
    family.drops_finished_rows = drops_finished_rows
    return ModuleRollout(model, family, tokenizer).generate(prompts, sampling)


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingParams(max_tokens=12, temperature=0.9, top_k=5, seed=1, min_tokens=2),
        SamplingParams(max_tokens=12, do_sample=False),
        # room for LONG_SEQUENCE positions: the in-place cache, rows leaving it as they stop
        SamplingParams(max_tokens=LONG_SEQUENCE, temperature=0.9, seed=2, min_tokens=2),
    ],
    ids=["sampled", "greedy", "sampled-long"],
)
def test_decode_rows_samples_what_generate_samples(lm, sampling):
    # Digits and EOS only, and "1" stops a row too, so that rows stop at different steps.
    digits = tuple(lm[1].convert_tokens_to_ids(list("0123")))
    sampling = dataclasses.replace(sampling, allowed_token_ids=digits, stop_token_ids=digits[1:2])
    ours = rollout(lm, sampling, drops_finished_rows=True)
    theirs = rollout(lm, sampling, drops_finished_rows=False)
    lengths = ours["response_mask"].sum(1)
    assert len(set(lengths.tolist())) > 1, "rows should stop at different steps"
    if sampling.min_tokens:
        assert lengths.min() > sampling.min_tokens
    assert torch.equal(ours["responses"], theirs["responses"])
    assert torch.equal(ours["response_mask"], theirs["response_mask"])
    mask = ours["response_mask"].bool()
    diff = (ours["rollout_log_probs"] - theirs["rollout_log_probs"]).abs()[mask]
    assert diff.max() < 1e-5


def test_stopped_rows_leave_the_forward_pass(lm):
    model, tokenizer, prompts = lm
    eos, prompt_len = tokenizer.eos_token_id, prompts["input_ids"].shape[1]
    stop_step = torch.arange(len(prompts)) % 6  # row r stops at step r % 6

    class StopAtRowStep:
        def __call__(self, input_ids, scores):
            out = scores.clone()
            out[:, eos] = float("-inf")
            rows = stop_step == input_ids.shape[1] - prompt_len
            out[rows] = float("-inf")
            out[rows, eos] = 0.0
            return out

    rows_per_call: list[int] = []
    hook = model.register_forward_pre_hook(
        lambda _, args, kwargs: rows_per_call.append(kwargs["input_ids"].shape[0]),
        with_kwargs=True,
    )
    args = (prompts["input_ids"], prompts["attention_mask"], LogitsProcessorList([StopAtRowStep()]))
    try:
        sequences, scores = decode_rows(model, *args, 10, {eos}, tokenizer.pad_token_id)
    finally:
        hook.remove()
    # Call 0 runs each distinct prompt once (every prompt is there twice); call t computes
    # step t for the rows that had not stopped by t - 1.
    assert len(prompts) == 2 * len(PROMPTS)
    assert rows_per_call == [len(PROMPTS)] + [int((stop_step >= t).sum()) for t in range(1, 6)]
    responses = sequences[:, prompt_len:]
    assert len(scores) == responses.shape[1] == 6
    assert torch.equal(
        responses[torch.arange(len(prompts)), stop_step], torch.full_like(stop_step, eos)
    )
    after = torch.arange(6)[None] > stop_step[:, None]
    assert (responses[after] == tokenizer.pad_token_id).all()
    # generate computes every row at every step, and samples the same.
    reference, _ = transformers_generate(model, *args, 10, {eos}, tokenizer.pad_token_id)
    assert torch.equal(reference, sequences)
