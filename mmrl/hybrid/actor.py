"""The policy side of a PPO step: per-step log-probs and the actor update.

These functions take a plain ``nn.Module`` and its :class:`~mmrl.models.PolicyFamily`,
which scores the response steps; the worker decides how the module is wrapped
(in-process, FSDP) and where it runs.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import numpy as np
import torch
from torch import nn

from mmrl import algos
from mmrl.config import ActorConfig
from mmrl.hybrid.minibatch import ppo_minibatches, token_budget_groups
from mmrl.models import PolicyFamily
from mmrl.models.attention_kernel import training_attention
from mmrl.models.padding import pad_steps
from mmrl.protocol import Batch


@torch.no_grad()
def compute_log_probs(
    family: PolicyFamily,
    model: nn.Module,
    batch: Batch,
    micro_batch_size: int,
    temperature: float,
    trim: bool = True,
    max_tokens: int | None = None,
    pack: bool = False,
    share_prompts: bool = False,
) -> torch.Tensor:
    """Log-probs [B, T] of the responses, computed in micro-batches without gradients; with
    ``trim``, each micro-batch runs without the padding no row of it uses (zeros there). With
    ``max_tokens``, micro-batches group rows of similar length up to that many tokens
    (:func:`~mmrl.hybrid.minibatch.token_budget_groups`)."""
    was_training = model.training
    model.eval()
    if max_tokens is None:
        groups = [
            np.arange(i, min(i + micro_batch_size, len(batch)))
            for i in range(0, len(batch), micro_batch_size)
        ]
    else:
        groups = token_budget_groups(batch, max_tokens)
    log_probs = None
    for rows in groups:
        part = response_log_probs(
            family, model, batch[rows], temperature, trim, pack=pack, share_prompts=share_prompts
        )[0]
        if log_probs is None:
            log_probs = part.new_zeros(len(batch), *part.shape[1:])
        log_probs[torch.from_numpy(rows)] = part
    model.train(was_training)
    return log_probs


def response_log_probs(
    family: PolicyFamily,
    model: nn.Module,
    batch: Batch,
    temperature: float,
    trim: bool,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    pack: bool = False,
    math_attention_max_len: int = 0,
    share_prompts: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The family's log-probs (and entropies) [b, T]; with ``trim`` the forward pass runs
    without the padding no row uses, and the steps it skipped come back as zeros, so the loss
    sees the batch's own shape (Dr.GRPO's ``seq-mean-token-sum-norm`` divides by T). With
    ``pack`` as well, a family that packs rows runs them end to end without any padding
    (:mod:`mmrl.models.packing`), and with ``share_prompts`` rows with the same prompt may
    run it once (:mod:`mmrl.models.prompt_sharing`). A forward pass with gradients over
    sequences of at most ``math_attention_max_len`` tokens runs torch's math attention kernel
    on the CPU (:func:`~mmrl.models.attention_kernel.training_attention`)."""
    batch_in = family.trim_padding(batch) if trim else batch
    with _attention_kernel(batch_in, math_attention_max_len):
        packed = None
        if pack and trim and family.packs_rows:
            packed = family.packed_response_log_probs(
                model, batch_in, temperature, with_entropy, entropy_grad, share_prompts
            )
        log_probs, entropy = packed or family.response_log_probs(
            model, batch_in, temperature, with_entropy, entropy_grad
        )
    if not trim:
        return log_probs, entropy
    steps = batch["responses"].shape[1] if "responses" in batch else log_probs.shape[1]
    return pad_steps(log_probs, steps), None if entropy is None else pad_steps(entropy, steps)


def _attention_kernel(batch: Batch, math_attention_max_len: int) -> AbstractContextManager:
    """The attention kernel for ``batch``'s forward pass (its token columns decide)."""
    if "input_ids" not in batch:
        return nullcontext()
    ids = batch["input_ids"]
    return training_attention(ids.shape[1], ids.device, math_attention_max_len)


def update_policy(
    family: PolicyFamily,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Batch,
    cfg: ActorConfig,
    mini_batch_size: int,
    temperature: float,
    seed: int,
    trim: bool = True,
    rollout_is: tuple[str, float] | None = None,
    pack: bool = False,
    share_prompts: bool = False,
) -> dict[str, float]:
    """PPO epochs over shuffled mini-batches, accumulating gradients over micro-batches.

    ``batch`` needs ``advantages``, ``response_mask``, ``valid_mask`` and, with
    ``cfg.use_kl_loss``, ``ref_log_prob``. Without ``old_log_probs`` (the on-policy case:
    one epoch, one mini-batch) they are the update's own forward pass, detached: every
    micro-batch runs forward before the one optimizer step, so these are the log-probs of
    the policy that sampled, and the forward pass a recomputation would make is saved. Then
    ``rollout/logprob_diff_*`` come from that pass, and so do the truncated importance weights
    of ``rollout_is`` (``algorithm.rollout_is`` and its cap) when the batch has none. With
    ``trim``, micro-batches run without the padding no row of them uses. Returns averaged
    ``actor/*`` metrics.
    """
    if "old_log_probs" not in batch and (cfg.ppo_epochs > 1 or mini_batch_size < len(batch)):
        raise ValueError(
            "the batch has no old_log_probs, but the update is not on-policy "
            f"(ppo_epochs={cfg.ppo_epochs}, {len(batch)} samples in mini-batches of "
            f"{mini_batch_size}): recompute them first (actor.old_log_prob=recompute)"
        )
    loss_fn = algos.get_policy_loss(cfg.policy_loss.loss_mode)
    # A loss may aggregate otherwise than loss_agg_mode (GSPO: gspo_loss_agg_mode); its
    # micro-batches are weighted by its own mode, or the sum would depend on the split.
    pg_mode = algos.pg_loss_agg_mode(cfg)
    metrics = ppo_minibatches(
        model,
        optimizer,
        batch,
        lambda micro, weights: _micro_step(
            family,
            model,
            micro,
            cfg,
            loss_fn,
            temperature,
            weights,
            rollout_is,
            trim=trim,
            pack=pack,
            share_prompts=share_prompts,
        ),
        epochs=cfg.ppo_epochs,
        mini_batch_size=mini_batch_size,
        micro_batch_size=cfg.ppo_micro_batch_size,
        # The third weighs the token means among the metrics (clip fraction, ratio KL).
        loss_agg_modes=(pg_mode, cfg.loss_agg_mode, "token-mean"),
        grad_clip=cfg.grad_clip,
        seed=seed,
        prefix="actor",
        max_tokens=cfg.ppo_max_token_len_per_gpu if cfg.use_dynamic_bsz else None,
        by_prompt=share_prompts and pack,
    )
    metrics["actor/lr"] = optimizer.param_groups[0]["lr"]
    return metrics


def _micro_step(
    family, model, micro, cfg, loss_fn, temperature, weights, rollout_is, **forward
) -> dict:
    """One micro-batch's backward; ``weights``: (policy-loss weight, weight of the other
    terms, token-mean weight), each the micro-batch's share of the mini-batch under its
    aggregation. Each metric names the weight its mean over micro-batches takes. ``forward``:
    :func:`response_log_probs`'s ``trim``, ``pack`` and ``share_prompts``."""
    mask, valid = micro["response_mask"], micro["valid_mask"]
    # Without an entropy bonus the entropy is only logged: no graph is kept for it.
    log_prob, entropy = response_log_probs(
        family,
        model,
        micro,
        temperature,
        with_entropy=True,
        entropy_grad=cfg.entropy_coeff != 0,
        math_attention_max_len=cfg.math_attention_max_len,
        **forward,
    )
    out = {}
    if "old_log_probs" in micro:
        old_log_prob = micro["old_log_probs"]
    else:  # on-policy: this forward pass is the sampling policy's (see update_policy)
        old_log_prob = log_prob.detach()
        out = {k: (v, 2) for k, v in logprob_diff(micro, old_log_prob).items()}
        if rollout_is and "rollout_log_probs" in micro:
            micro["rollout_is_weights"], is_metrics = algos.rollout_is_weights(
                old_log_prob, micro["rollout_log_probs"], mask, *rollout_is
            )
            out.update({k: (v, 2) for k, v in is_metrics.items()})
    advantages = micro["advantages"]
    if "rollout_is_weights" in micro:  # weights > 0, so this scales each token's clipped loss term
        advantages = advantages * micro["rollout_is_weights"]
    pg_loss, pg_metrics = loss_fn(
        old_log_prob=old_log_prob,
        log_prob=log_prob,
        advantages=advantages,
        response_mask=mask,
        valid_mask=valid,
        config=cfg,
    )
    entropy_loss = algos.agg_loss(entropy, mask, cfg.loss_agg_mode, valid_mask=valid)
    pg_weight, weight, _ = weights
    loss = -cfg.entropy_coeff * entropy_loss
    out.update({"actor/pg_loss": (pg_loss.item(), 0), "actor/entropy": (entropy_loss.item(), 1)})
    if cfg.use_kl_loss:
        kl = algos.kl_penalty(log_prob, micro["ref_log_prob"], cfg.kl_loss_type)
        kl_loss = algos.agg_loss(kl, mask, cfg.loss_agg_mode, valid_mask=valid)
        loss = loss + cfg.kl_loss_coef * kl_loss
        out.update({"actor/kl_loss": (kl_loss.item(), 1), "actor/kl_coef": (cfg.kl_loss_coef, 1)})
    (pg_loss * pg_weight + loss * weight).backward()
    out.update({f"actor/{k}": (float(v), 2) for k, v in pg_metrics.items()})
    return out


def logprob_diff(micro: Batch, log_prob: torch.Tensor) -> dict[str, float]:
    """``rollout/logprob_diff_max`` and ``_mean``: the rollout engine's log-probs of the sampled
    tokens against ``log_prob`` [b, T], over response steps (as the fit loop reports them)."""
    if "rollout_log_probs" not in micro:
        return {}
    diff = (micro["rollout_log_probs"] - log_prob).abs()[micro["response_mask"].bool()]
    if not diff.numel():
        return {}
    return {
        "rollout/logprob_diff_max": float(diff.max()),
        "rollout/logprob_diff_mean": float(diff.mean()),
    }
