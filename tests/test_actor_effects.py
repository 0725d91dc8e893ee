"""Every actor setting changes the update as its formula says.

A tiny Qwen2 takes one plain SGD step (lr 1, no clipping) on a fixed batch through
:func:`mmrl.hybrid.actor.update_policy`, split into uneven micro-batches. The weight change
must equal minus the gradient of the loss written out here by hand, from the model's own
logits, with no call into mmrl.algos: a registry that hands back the wrong loss, a dropped
importance weight or KL term, or a wrong aggregation changes the step and fails the test.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from mmrl.algos import AGG_MODES, KL_PENALTIES, POLICY_LOSSES
from mmrl.config import ActorConfig, PolicyLossConfig
from mmrl.hybrid.actor import update_policy
from mmrl.models import get_family
from mmrl.protocol import Batch

TEXT_LM = get_family("text_lm")

B, P, T, V = 7, 3, 5, 24
LENGTHS = [5, 3, 1, 4, 5, 2, 5]  # response tokens per row; row 5 is invalid below


@pytest.fixture(scope="module")
def model() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=16,
        tie_word_embeddings=False,
    )
    return Qwen2ForCausalLM(config).float()


def response_log_probs_and_entropy(
    model, batch: Batch, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """The response tokens' log-probs and entropies, written out from the logits."""
    logits = model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        position_ids=batch["position_ids"],
    ).logits[:, P - 1 : P + T - 1]
    logp_all = torch.log_softmax(logits.float() / temperature, -1)
    logp = logp_all.gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


@pytest.fixture(scope="module")
def batch(model) -> Batch:
    """Ratios from 0.3 to 3 (both clip edges and the dual clip are hit), advantages of both
    signs, importance weights far from 1, a reference that differs from the actor."""
    gen = torch.Generator().manual_seed(1)
    input_ids = torch.randint(3, V, (B, P + T), generator=gen)
    responses = input_ids[:, P:]
    response_mask = (torch.arange(T)[None] < torch.tensor(LENGTHS)[:, None]).float()
    attention_mask = torch.cat([torch.ones(B, P), response_mask], dim=1).long()
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    out = Batch.from_dict(
        {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": position_ids,
            "responses": responses,
            "response_mask": response_mask,
            "valid_mask": torch.tensor([True] * 5 + [False, True]),
        }
    )
    with torch.no_grad():
        logp, _ = response_log_probs_and_entropy(model, out)
    out["old_log_probs"] = logp + torch.empty(B, T).uniform_(-1.2, 1.2, generator=gen)
    out["ref_log_prob"] = logp + torch.empty(B, T).uniform_(-0.8, 0.8, generator=gen)
    out["advantages"] = torch.randn(B, T, generator=gen) * 2
    out["rollout_is_weights"] = torch.empty(B, T).uniform_(0.2, 2.0, generator=gen)
    return out


# --- the losses, by hand ------------------------------------------------------------------


def aggregate(loss: torch.Tensor, keep: torch.Tensor, mode: str) -> torch.Tensor:
    rows = [i for i in range(B) if keep[i].any()]
    if mode == "token-mean":
        return loss[keep].sum() / keep.sum()
    per_row = []
    for i in rows:
        s = loss[i][keep[i]].sum()
        if mode == "seq-mean-token-sum":
            per_row.append(s)
        elif mode == "seq-mean-token-mean":
            per_row.append(s / keep[i].sum())
        elif mode == "seq-mean-token-sum-norm":
            per_row.append(s / T)
    return torch.stack(per_row).mean()


def vanilla(logp, old, adv, cfg: ActorConfig) -> tuple[torch.Tensor, str]:
    ratio = torch.exp(logp - old)
    loss = torch.maximum(
        -adv * ratio, -adv * ratio.clamp(1 - cfg.clip_ratio_low, 1 + cfg.clip_ratio_high)
    )
    if cfg.clip_ratio_c is not None:
        loss = torch.where(adv < 0, torch.minimum(loss, -adv * cfg.clip_ratio_c), loss)
    return loss, cfg.loss_agg_mode


def cispo(logp, old, adv, cfg: ActorConfig) -> tuple[torch.Tensor, str]:
    # No CISPO bound of its own: the upper bound is the actor's clip_ratio_high, no lower bound.
    high = cfg.policy_loss.cispo_clip_ratio_high
    high = cfg.clip_ratio_high if high is None else high
    weight = torch.exp(logp - old).detach().clamp(max=1 + high)
    return -weight * adv * logp, cfg.loss_agg_mode


def gspo(logp, old, adv, cfg: ActorConfig, keep=None) -> tuple[torch.Tensor, str]:
    seq = ((logp - old) * keep).sum(-1) / keep.sum(-1).clamp(min=1)
    ratio = torch.exp(logp - logp.detach() + seq.detach()[:, None])
    knobs = cfg.policy_loss
    clipped = ratio.clamp(1 - knobs.gspo_clip_ratio_low, 1 + knobs.gspo_clip_ratio_high)
    loss = torch.maximum(-adv * ratio, -adv * clipped)
    # GSPO aggregates by its own mode (per sequence by default), not actor.loss_agg_mode.
    return loss, knobs.gspo_loss_agg_mode


HAND_LOSSES = {"vanilla": vanilla, "cispo": cispo, "gspo": gspo}
HAND_KL = {
    "k1": lambda d: d,
    "abs": lambda d: d.abs(),
    "k2": lambda d: 0.5 * d**2,
    "k3": lambda d: torch.exp(-d) + d - 1,
}
HAND_KL.update(kl=HAND_KL["k1"], mse=HAND_KL["k2"], low_var_kl=HAND_KL["k3"])


def expected_grads(
    model, batch: Batch, cfg: ActorConfig, use_is: bool, temperature: float = 1.0
) -> dict[str, torch.Tensor]:
    model = copy.deepcopy(model)
    keep = batch["response_mask"].bool() & batch["valid_mask"][:, None]
    logp, entropy = response_log_probs_and_entropy(model, batch, temperature)
    adv = batch["advantages"] * (batch["rollout_is_weights"] if use_is else 1.0)
    fn = HAND_LOSSES[cfg.policy_loss.loss_mode]
    kwargs = {"keep": keep.float()} if cfg.policy_loss.loss_mode == "gspo" else {}
    pg, mode = fn(logp, batch["old_log_probs"], adv, cfg, **kwargs)
    loss = aggregate(pg, keep, mode) - cfg.entropy_coeff * aggregate(
        entropy, keep, cfg.loss_agg_mode
    )
    if cfg.use_kl_loss:
        kl = HAND_KL[cfg.kl_loss_type](logp - batch["ref_log_prob"])
        loss = loss + cfg.kl_loss_coef * aggregate(kl, keep, cfg.loss_agg_mode)
    loss.backward()
    return {n: p.grad for n, p in model.named_parameters()}


def actor_grads(
    model, batch: Batch, cfg: ActorConfig, temperature: float = 1.0
) -> dict[str, torch.Tensor]:
    """Minus the weight change of one SGD step with lr 1: the gradient the actor applied."""
    model = copy.deepcopy(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    update_policy(
        TEXT_LM,
        model,
        torch.optim.SGD(model.parameters(), lr=1.0),
        batch.clone(),
        cfg,
        mini_batch_size=B,
        temperature=temperature,
        seed=0,
    )
    return {n: before[n] - p.detach() for n, p in model.named_parameters()}


def base_config(**kw) -> ActorConfig:
    """The actor config with test settings; ``policy_loss="cispo"`` selects a loss with its
    default settings."""
    if isinstance(kw.get("policy_loss"), str):
        kw["policy_loss"] = PolicyLossConfig(kw["policy_loss"])
    settings = dict(
        ppo_micro_batch_size=3,  # micro-batches of 3, 3, 1 rows: their weights must add up
        grad_clip=1e9,
        use_kl_loss=False,
        entropy_coeff=0.0,
    )
    return dataclasses.replace(ActorConfig(), **{**settings, **kw})


def assert_same(got: dict, want: dict) -> None:
    scale = max(float(g.abs().max()) for g in want.values())
    assert scale > 1e-4, "the expected gradient is zero: the batch tests nothing"
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, atol=2e-5 * scale, rtol=1e-4, msg=name)


def test_every_policy_loss_has_a_hand_written_expectation():
    assert set(POLICY_LOSSES) == set(HAND_LOSSES)
    assert set(KL_PENALTIES) == set(HAND_KL)


@pytest.mark.parametrize("loss", sorted(HAND_LOSSES))
@pytest.mark.parametrize("mode", AGG_MODES)
def test_policy_loss_and_aggregation_reach_the_gradient(model, batch, loss, mode):
    cfg = base_config(policy_loss=loss, loss_agg_mode=mode)
    plain = batch.clone()
    plain.pop(["rollout_is_weights"])
    assert_same(actor_grads(model, plain, cfg), expected_grads(model, plain, cfg, use_is=False))


def test_policy_losses_and_modes_give_different_steps(model, batch):
    """The fixed batch separates the settings: equal steps would make the tests above vacuous."""
    plain = batch.clone()
    plain.pop(["rollout_is_weights"])
    steps = {}
    for loss in HAND_LOSSES:
        for mode in AGG_MODES:
            g = actor_grads(model, plain, base_config(policy_loss=loss, loss_agg_mode=mode))
            steps[(loss, mode)] = torch.cat([v.flatten() for v in g.values()])
    keys = list(steps)
    for i, a in enumerate(keys):
        for b in keys[i + 1 :]:
            if a[0] == b[0] == "gspo":
                continue  # GSPO's aggregation is its own
            assert not torch.allclose(steps[a], steps[b], rtol=1e-3, atol=1e-7), (a, b)


@pytest.mark.parametrize("loss", sorted(HAND_LOSSES))
def test_rollout_importance_weights_scale_the_gradient(model, batch, loss):
    """Weights between 0.2 and 2 multiply each token's advantage; dropping them changes the
    step."""
    cfg = base_config(policy_loss=loss)
    got = actor_grads(model, batch, cfg)
    assert_same(got, expected_grads(model, batch, cfg, use_is=True))
    unweighted = expected_grads(model, batch, cfg, use_is=False)
    name = next(iter(got))
    assert not torch.allclose(got[name], unweighted[name], rtol=1e-2)


@pytest.mark.parametrize("kind", sorted(KL_PENALTIES))
def test_kl_loss_type_and_coefficient_reach_the_gradient(model, batch, kind):
    cfg = base_config(use_kl_loss=True, kl_loss_type=kind, kl_loss_coef=0.5)
    plain = batch.clone()
    plain.pop(["rollout_is_weights"])
    assert_same(actor_grads(model, plain, cfg), expected_grads(model, plain, cfg, use_is=False))


def test_entropy_bonus_reaches_the_gradient(model, batch):
    cfg = base_config(entropy_coeff=0.3)
    plain = batch.clone()
    plain.pop(["rollout_is_weights"])
    got = actor_grads(model, plain, cfg)
    assert_same(got, expected_grads(model, plain, cfg, use_is=False))
    without = actor_grads(model, plain, base_config())
    name = "model.embed_tokens.weight"
    assert not torch.allclose(got[name], without[name], rtol=1e-3)


def test_ppo_epochs_take_one_step_per_epoch(model, batch):
    """Two epochs over one mini-batch = two SGD steps, the second at the moved weights."""
    plain = batch.clone()
    plain.pop(["rollout_is_weights"])
    cfg = base_config(ppo_epochs=2)
    by_hand = copy.deepcopy(model)
    for _ in range(2):
        grads = expected_grads(by_hand, plain, base_config(), use_is=False)
        with torch.no_grad():
            for n, p in by_hand.named_parameters():
                p -= grads[n]
    moved = copy.deepcopy(model)
    update_policy(
        TEXT_LM,
        moved,
        torch.optim.SGD(moved.parameters(), lr=1.0),
        plain.clone(),
        cfg,
        B,
        1.0,
        seed=0,
    )
    for (n, p), q in zip(moved.named_parameters(), by_hand.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-4, msg=n)


def test_a_non_finite_gradient_skips_the_step(model, batch):
    poisoned = batch.clone()
    poisoned.pop(["rollout_is_weights"])
    adv = poisoned["advantages"].clone()
    adv[0, 0] = float("nan")
    poisoned["advantages"] = adv
    moved = copy.deepcopy(model)
    metrics = update_policy(
        TEXT_LM,
        moved,
        torch.optim.SGD(moved.parameters(), lr=1.0),
        poisoned,
        base_config(),
        B,
        1.0,
        seed=0,
    )
    assert metrics["actor/skipped_steps"] == 1.0
    for p, q in zip(moved.parameters(), model.parameters(), strict=True):
        assert torch.equal(p, q)


def test_clip_settings_and_temperature_reach_the_gradient(model, batch):
    """Non-default clip ratios and a rollout temperature: the actor must use them, not the
    loss's own defaults or temperature 1 (mutation testing found both unchecked)."""
    plain = batch.clone()
    plain.pop(["rollout_is_weights"])
    cfg = base_config(clip_ratio_low=0.1, clip_ratio_high=0.5, clip_ratio_c=1.5)
    got = actor_grads(model, plain, cfg, temperature=0.7)
    assert_same(got, expected_grads(model, plain, cfg, use_is=False, temperature=0.7))
    name = "lm_head.weight"
    assert not torch.allclose(got[name], actor_grads(model, plain, base_config())[name])
    assert not torch.allclose(got[name], actor_grads(model, plain, cfg)[name])
