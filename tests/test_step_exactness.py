"""The GRPO step's shortcuts change its cost, not its numbers.

A tiny Qwen2 scores a batch whose prompts are left-padded and whose responses are
right-padded to different lengths, split into micro-batches that each have padding
columns no row of theirs uses. Trimmed micro-batches, micro-batches built by a token
budget, the head run on the response positions alone (``logits_to_keep``) and old
log-probs taken from the update's own forward pass must each give what the plain
computation gives.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from mmrl import algos
from mmrl.config import ActorConfig, load_config, old_log_prob_source
from mmrl.errors import ConfigError
from mmrl.hybrid.actor import compute_log_probs, update_policy
from mmrl.hybrid.minibatch import token_budget_groups
from mmrl.models import get_family
from mmrl.models.packing import pack_rows
from mmrl.models.padding import trim_padding
from mmrl.protocol import Batch

TEXT_LM = get_family("text_lm")
P, T, V = 6, 8, 24
PROMPT_LENGTHS = [2, 4, 3, 2, 2, 3]
RESPONSE_LENGTHS = [3, 5, 2, 6, 1, 4]
MICRO = 4  # micro-batches of rows 0-3 (prompts <= 4, responses <= 6) and 4-5 (<= 3, <= 4)


@pytest.fixture(scope="module")
def model() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=False,
    )
    return Qwen2ForCausalLM(config).float()


@pytest.fixture(scope="module")
def batch() -> Batch:
    return padded_batch(PROMPT_LENGTHS, RESPONSE_LENGTHS, P, T, seed=1)


def padded_batch(
    prompt_lengths: list[int],
    response_lengths: list[int],
    width: int,
    steps: int,
    seed: int,
    rows_per_prompt: int = 1,
) -> Batch:
    """Rows of random tokens: prompts of ``prompt_lengths`` left-padded to ``width``, each
    shared by ``rows_per_prompt`` consecutive rows, and responses of ``response_lengths``
    right-padded to ``steps``, with random advantages."""
    gen = torch.Generator().manual_seed(seed)
    n = len(prompt_lengths)
    prompt_mask = (
        torch.arange(width)[None] >= width - torch.tensor(prompt_lengths)[:, None]
    ).long()
    response_mask = (torch.arange(steps)[None] < torch.tensor(response_lengths)[:, None]).float()
    attention_mask = torch.cat([prompt_mask, response_mask.long()], dim=1)
    input_ids = torch.randint(3, V, (n, width + steps), generator=gen)
    shared = torch.arange(n) // rows_per_prompt * rows_per_prompt
    input_ids[:, :width] = input_ids[shared, :width]
    input_ids = input_ids * attention_mask  # pad id 0
    out = Batch.from_dict(
        {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
            "responses": input_ids[:, width:],
            "response_mask": response_mask,
            "valid_mask": torch.ones(n, dtype=torch.bool),
            "advantages": torch.randn(n, steps, generator=gen) * response_mask,
        }
    )
    out["rollout_log_probs"] = torch.zeros(n, steps)
    return out


def test_trimming_drops_only_columns_no_row_uses(batch):
    first, second = batch.split(MICRO)
    assert trim_padding(first)["input_ids"].shape[1] == 4 + 6
    assert trim_padding(second)["input_ids"].shape[1] == 3 + 4
    assert trim_padding(second)["advantages"].shape[1] == 4
    kept = trim_padding(second)
    assert kept["attention_mask"].sum() == second["attention_mask"].sum()


def test_token_budget_groups_sort_by_length_and_fit_the_budget(batch):
    groups = token_budget_groups(batch, max_tokens=24)
    lengths = [p + r for p, r in zip(PROMPT_LENGTHS, RESPONSE_LENGTHS, strict=True)]
    assert [lengths[i] for g in groups for i in g] == sorted(lengths, reverse=True)
    assert sorted(i for g in groups for i in g) == list(range(len(batch)))
    for g in groups:
        width = max(PROMPT_LENGTHS[i] for i in g) + max(RESPONSE_LENGTHS[i] for i in g)
        assert len(g) * width <= 24 or len(g) == 1
    assert 1 < len(groups) < len(batch)


def test_trimmed_micro_batches_give_the_padded_log_probs(model, batch):
    padded = compute_log_probs(TEXT_LM, model, batch, MICRO, temperature=0.7, trim=False)
    trimmed = compute_log_probs(TEXT_LM, model, batch, MICRO, temperature=0.7, trim=True)
    by_tokens = compute_log_probs(TEXT_LM, model, batch, MICRO, 0.7, trim=True, max_tokens=24)
    mask = batch["response_mask"].bool()
    torch.testing.assert_close(trimmed[mask], padded[mask], atol=1e-5, rtol=0)
    torch.testing.assert_close(by_tokens[mask], padded[mask], atol=1e-5, rtol=0)
    # Steps past a micro-batch's longest response were never computed.
    assert (trimmed[:MICRO, 6:] == 0).all() and (trimmed[MICRO:, 4:] == 0).all()


def test_packed_rows_hold_each_row_end_to_end_with_positions_from_zero(batch):
    packed = pack_rows(batch)
    lengths = [p + r for p, r in zip(PROMPT_LENGTHS, RESPONSE_LENGTHS, strict=True)]
    width = max(lengths)
    # Rows of 9, 8, 7, 5, 5 and 3 tokens, first fit into bins of 9: [9], [8], [7], [5, 3], [5].
    assert packed.input_ids.shape == (5, width)
    assert packed.steps.sum() == sum(RESPONSE_LENGTHS) == len(packed.score_index)
    flat_ids, flat_pos = packed.input_ids.flatten(), packed.position_ids.flatten()
    mask = batch["attention_mask"].bool()
    for row, (p, r) in enumerate(zip(PROMPT_LENGTHS, RESPONSE_LENGTHS, strict=True)):
        # The token before each response step is the one that scores it.
        first = int(packed.score_index[sum(RESPONSE_LENGTHS[:row])]) - (p - 1)
        assert torch.equal(flat_ids[first : first + p + r], batch["input_ids"][row][mask[row]])
        assert torch.equal(flat_pos[first : first + p + r], torch.arange(p + r))
    # 3-D rope positions, or positions that do not start at 0, are not packed.
    offset = batch.clone()
    offset["position_ids"] = offset["position_ids"] + 1
    assert pack_rows(offset) is None


def test_packed_micro_batches_give_the_padded_log_probs(model, batch):
    padded = compute_log_probs(TEXT_LM, model, batch, MICRO, temperature=0.7, trim=False)
    mask = batch["response_mask"].bool()
    for max_tokens in (None, 24):
        packed = compute_log_probs(
            TEXT_LM, model, batch, MICRO, 0.7, trim=True, max_tokens=max_tokens, pack=True
        )
        torch.testing.assert_close(packed[mask], padded[mask], atol=1e-5, rtol=0)
        assert (packed[~mask] == 0).all()


def test_the_head_on_response_positions_gives_the_full_logits_log_probs(model, batch):
    """``logits_to_keep``: the family's log-probs equal those of every position's logits."""
    with torch.no_grad():
        full = model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"],
        ).logits[:, P - 1 : P + T - 1]
        want = torch.log_softmax(full.float() / 0.7, -1)
        want = want.gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)
        got, _ = TEXT_LM.response_log_probs(model, batch, temperature=0.7)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


def step_grads(
    model,
    batch: Batch,
    trim: bool,
    family=TEXT_LM,
    temperature: float = 0.7,
    rollout_is: tuple[str, float] | None = None,
    pack: bool = False,
    share_prompts: bool = False,
    **actor: object,
) -> tuple[dict[str, torch.Tensor], dict]:
    """Minus the weight change of one SGD step with lr 1 (the gradient applied), and the
    update's metrics; ``actor`` overrides the ActorConfig fields set here."""
    model = copy.deepcopy(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    settings = dict(ppo_micro_batch_size=MICRO, grad_clip=1e9, use_kl_loss=False)
    cfg = dataclasses.replace(ActorConfig(), **{**settings, **actor})
    metrics = update_policy(
        family,
        model,
        torch.optim.SGD(model.parameters(), lr=1.0),
        batch.clone(),
        cfg,
        mini_batch_size=len(batch),
        temperature=temperature,
        seed=0,
        trim=trim,
        rollout_is=rollout_is,
        pack=pack,
        share_prompts=share_prompts,
    )
    return {n: before[n] - p.detach() for n, p in model.named_parameters()}, metrics


def assert_same_grads(got: dict, want: dict) -> None:
    scale = max(float(g.abs().max()) for g in want.values())
    assert scale > 1e-4, "the expected gradient is zero: the batch tests nothing"
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, atol=1e-5 * scale, rtol=1e-4, msg=name)


def test_trimmed_update_applies_the_padded_gradient(model, batch):
    with_old = batch.clone()
    with_old["old_log_probs"] = compute_log_probs(TEXT_LM, model, batch, MICRO, 0.7, trim=False)
    padded, padded_metrics = step_grads(model, with_old, trim=False)
    trimmed, trimmed_metrics = step_grads(model, with_old, trim=True)
    assert_same_grads(trimmed, padded)
    assert trimmed_metrics["actor/entropy"] == pytest.approx(padded_metrics["actor/entropy"])
    packed, packed_metrics = step_grads(model, with_old, trim=True, pack=True)
    assert_same_grads(packed, padded)
    assert packed_metrics["actor/entropy"] == pytest.approx(padded_metrics["actor/entropy"])
    for mode in ("token-mean", "seq-mean-token-sum-norm"):
        want, _ = step_grads(model, with_old, trim=False, loss_agg_mode=mode)
        by_tokens, _ = step_grads(
            model,
            with_old,
            trim=True,
            loss_agg_mode=mode,
            use_dynamic_bsz=True,
            ppo_max_token_len_per_gpu=24,
        )
        assert_same_grads(by_tokens, want)


def test_on_policy_old_log_probs_give_the_recomputed_loss_and_gradient(model, batch):
    recomputed = batch.clone()
    recomputed["old_log_probs"] = compute_log_probs(TEXT_LM, model, batch, MICRO, 0.7)
    noise = torch.linspace(0.01, 0.3, T).expand(len(batch), T) * batch["response_mask"]
    recomputed["rollout_log_probs"] = recomputed["old_log_probs"] + noise
    on_policy = recomputed.clone()
    on_policy.pop(["old_log_probs"])
    want, want_metrics = step_grads(model, recomputed, trim=True)
    got, got_metrics = step_grads(model, on_policy, trim=True)
    assert_same_grads(got, want)
    assert got_metrics["actor/pg_loss"] == pytest.approx(want_metrics["actor/pg_loss"], abs=1e-6)
    # The update's first forward pass reports the rollout gap the fit loop would have.
    assert got_metrics["rollout/logprob_diff_max"] == pytest.approx(float(noise.max()), abs=1e-5)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_on_policy_truncated_importance_weights_equal_the_recomputed_ones(model, batch, level):
    """``algorithm.rollout_is`` with the on-policy shortcut: the update weighs each term by the
    capped ratio of its own forward pass to the engine's log-probs, as the recomputing path
    does with the recomputed old log-probs."""
    recomputed = batch.clone()
    old = compute_log_probs(TEXT_LM, model, batch, MICRO, 0.7)
    mask = batch["response_mask"]
    sign = torch.tensor([1.0, -1.0]).repeat(len(batch) // 2)[:, None]
    gap = torch.linspace(-0.3, 0.3, T) * sign * mask  # some ratios over the cap, some under
    recomputed["old_log_probs"] = old
    recomputed["rollout_log_probs"] = old + gap
    weights, want_is = algos.rollout_is_weights(old, old + gap, mask, level, cap=1.2)
    assert 0 < want_is["rollout_is/capped_frac"] < 1
    recomputed["rollout_is_weights"] = weights
    on_policy = recomputed.clone()
    on_policy.pop(["old_log_probs", "rollout_is_weights"])
    want, _ = step_grads(model, recomputed, trim=True)
    got, got_metrics = step_grads(model, on_policy, trim=True, rollout_is=(level, 1.2))
    assert_same_grads(got, want)
    for key, value in want_is.items():
        assert got_metrics[key] == pytest.approx(value, abs=1e-5), key
    unweighted, _ = step_grads(model, on_policy, trim=True)
    assert not torch.allclose(unweighted["lm_head.weight"], want["lm_head.weight"], atol=1e-4)


def test_an_update_without_old_log_probs_must_be_on_policy(model, batch):
    cfg = dataclasses.replace(ActorConfig(), ppo_epochs=2, use_kl_loss=False)
    with pytest.raises(ValueError, match="not on-policy"):
        update_policy(
            TEXT_LM,
            copy.deepcopy(model),
            torch.optim.SGD(model.parameters(), lr=1.0),
            batch.clone(),
            cfg,
            mini_batch_size=len(batch),
            temperature=1.0,
            seed=0,
        )


def test_old_log_prob_auto_skips_the_recomputation_only_where_it_is_exact():
    on_policy = ["data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=8"]
    assert old_log_prob_source(load_config(on_policy)) == "update"
    for blocker in (
        "actor_rollout_ref.actor.ppo_epochs=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "algorithm.use_kl_in_reward=true",
    ):
        assert old_log_prob_source(load_config([*on_policy, blocker])) == "recompute", blocker
        with pytest.raises(ConfigError, match="old_log_prob=update"):
            load_config([*on_policy, blocker, "actor_rollout_ref.actor.old_log_prob=update"])
    # Truncated importance weights come from the update's own forward pass too.
    assert old_log_prob_source(load_config([*on_policy, "algorithm.rollout_is=token"])) == "update"
    rollout = load_config([*on_policy, "actor_rollout_ref.actor.old_log_prob=rollout"])
    assert old_log_prob_source(rollout) == "rollout"


def attention_ops(run) -> set[str]:
    """The scaled-dot-product attention operators ``run()`` called."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        run()
    return {e.name for e in prof.events() if "scaled_dot_product" in e.name}


@pytest.mark.parametrize("pack", [False, True], ids=["trimmed", "packed"])
def test_the_math_attention_kernel_applies_the_flash_kernels_gradient(model, batch, pack):
    with_old = batch.clone()
    with_old["old_log_probs"] = compute_log_probs(TEXT_LM, model, batch, MICRO, 0.7, trim=False)
    grads = {}

    def update(max_len: int) -> None:
        grads[max_len], _ = step_grads(
            model, with_old, trim=True, pack=pack, math_attention_max_len=max_len
        )

    flash_ops = attention_ops(lambda: update(0))
    math_ops = attention_ops(lambda: update(P + T))  # rows of P + T tokens or fewer
    assert any("flash" in op for op in flash_ops)
    assert "aten::_scaled_dot_product_attention_math" in math_ops
    assert not any("flash" in op for op in math_ops)
    assert attention_ops(lambda: update(P + T - 9)) == flash_ops  # longer rows: flash again
    assert_same_grads(grads[P + T], grads[0])
    # Log-probs without gradients keep torch's own (flash) kernel.
    no_grad_ops = attention_ops(lambda: compute_log_probs(TEXT_LM, model, batch, MICRO, 0.7))
    assert not any("math" in op for op in no_grad_ops)
