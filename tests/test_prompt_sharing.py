"""A GRPO group's prompt run once in the training forward pass gives every row's numbers.

Three prompts of six to eight tokens, each with three responses of one to three tokens: the
rows that share a prompt become one sequence (the prompt, then each response), which must
give the padded rows' log-probs and gradient.
"""

from __future__ import annotations

import pytest
import torch

from mmrl.hybrid.actor import compute_log_probs
from mmrl.hybrid.minibatch import micro_batches
from mmrl.models.prompt_sharing import shared_prompt_rows
from mmrl.protocol import Batch
from tests.test_step_exactness import (
    TEXT_LM,
    assert_same_grads,
    model,
    padded_batch,
    step_grads,
)

__all__ = ["model"]  # the tiny Qwen2 fixture
P, T = 8, 4
PROMPT_LENGTHS = [8, 8, 8, 6, 6, 6, 7, 7, 7]
RESPONSE_LENGTHS = [3, 1, 2, 2, 3, 1, 1, 1, 3]


@pytest.fixture(scope="module")
def grouped() -> Batch:
    return padded_batch(PROMPT_LENGTHS, RESPONSE_LENGTHS, P, T, seed=2, rows_per_prompt=3)


def shared_and_padded_grads(model, batch: Batch, micro_batch_size: int) -> tuple:
    """The update's gradient and metrics with shared prompts, then with padded rows."""
    with_old = batch.clone()
    with_old["old_log_probs"] = compute_log_probs(TEXT_LM, model, batch, 9, 0.7, trim=False)
    return (
        step_grads(
            model,
            with_old,
            trim=True,
            pack=True,
            share_prompts=True,
            ppo_micro_batch_size=micro_batch_size,
        ),
        step_grads(model, with_old, trim=False, ppo_micro_batch_size=micro_batch_size),
    )


def test_a_group_is_one_sequence_whose_responses_see_the_prompt_and_themselves(grouped):
    shared = shared_prompt_rows(grouped)
    assert shared is not None
    assert shared.input_ids.shape == (3, 8 + 3 + 1 + 2)  # the longest: 8 prompt + 6 tokens
    first = shared.input_ids[0]
    assert first[:8].tolist() == grouped["input_ids"][0, :8].tolist()
    assert first[8:11].tolist() == grouped["responses"][0, :3].tolist()
    # Each response's positions continue from the prompt's end.
    assert shared.position_ids[0].tolist() == [*range(8), 8, 9, 10, 8, 8, 9]
    seen = shared.attention_mask[0, 0]
    assert seen[13].tolist() == [True] * 8 + [False] * 4 + [True, True]  # row 2's 2nd token
    assert seen[11].tolist() == [True] * 8 + [False] * 3 + [True, False, False]  # row 1's
    assert len(shared.score_index) == sum(RESPONSE_LENGTHS)
    # Step 0 of every row is scored at its prompt's last token.
    assert shared.score_index[[0, 3, 4]].tolist() == [7, 7, 7]
    assert shared.score_index[[1, 2, 5]].tolist() == [8, 9, 12]


def test_sharing_is_skipped_where_it_would_not_halve_the_tokens(grouped):
    assert shared_prompt_rows(grouped[[0, 3, 6]]) is None  # three prompts, once each
    assert shared_prompt_rows(grouped, max_token_share=0.3) is None


def test_shared_prompts_give_the_padded_log_probs(model, grouped):
    padded = compute_log_probs(TEXT_LM, model, grouped, 9, temperature=0.7, trim=False)
    shared = compute_log_probs(
        TEXT_LM, model, grouped, 9, 0.7, trim=True, pack=True, share_prompts=True
    )
    mask = grouped["response_mask"].bool()
    torch.testing.assert_close(shared[mask], padded[mask], atol=1e-5, rtol=0)
    assert (shared[~mask] == 0).all()


def test_shared_prompts_apply_the_padded_gradient(model, grouped):
    (shared, shared_metrics), (padded, padded_metrics) = shared_and_padded_grads(model, grouped, 9)
    assert_same_grads(shared, padded)
    assert shared_metrics["actor/entropy"] == pytest.approx(padded_metrics["actor/entropy"])


def test_micro_batches_hold_whole_groups_of_shuffled_rows(model, grouped):
    shuffled = grouped[[4, 0, 8, 2, 3, 7, 1, 5, 6]]
    micros = micro_batches(shuffled, 3, None, by_prompt=True)
    assert [len(prompts_of(micro)) for micro in micros] == [1, 1, 1]  # one prompt each
    assert [len(micro) for micro in micros] == [3, 3, 3]
    # Cut in the order given, a micro-batch of three shuffled rows holds two or three prompts.
    assert len(prompts_of(micro_batches(shuffled, 3, None)[0])) > 1
    (shared, _), (padded, _) = shared_and_padded_grads(model, shuffled, 3)
    assert_same_grads(shared, padded)


def prompts_of(micro: Batch) -> set[tuple[int, ...]]:
    return {tuple(row) for row in micro["input_ids"][:, :P].tolist()}
