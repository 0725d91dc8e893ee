"""The sampling contract between rollout engines, policy families and the actor.

:class:`SamplingParams` says how to sample. Engines record any restriction beyond
temperature/top-k/top-p in ``batch.meta["sampling_support"]`` (:func:`sampling_support`),
and log-prob recomputation applies the same restriction (:func:`restrict_logits`), so
rollout and training log-probs describe the distribution that was sampled from.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

# Batch meta key under which engines record the token restrictions they sampled under.
SUPPORT_KEY = "sampling_support"
# Prompt tensor int64 [B, T]: the token an engine writes at response step t instead of sampling
# (teacher-forced, e.g. a world model's known actions between predicted frames); -1 where it
# samples. Every row forces the same steps.
FORCED_KEY = "forced_response_ids"
# Prompt tensor int64 [B, F]: the response step of each predicted frame's last token, where a
# verifier's per-frame score [B, F] is placed as a token-level reward.
FRAME_END_KEY = "frame_end_steps"
# Prompt tensor int64 [B]: each row's own sampling seed (:func:`row_seeds`), so a row samples
# the same response however the batch is split over engine calls and ranks.
SEEDS_KEY = "sample_seeds"


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one response per prompt row.

    ``rollout_log_probs`` are the log-probs of the distribution actually sampled
    from: logits divided by ``temperature`` and restricted by ``top_k``/``top_p``.
    Greedy decoding reports the log-probs of the untempered distribution.
    """

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    do_sample: bool = True
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    seed: int | None = None
    # Constrained generation (e.g. visual tokens only). None allows the whole vocabulary.
    allowed_token_ids: tuple[int, ...] | None = None
    # Responses of a fixed length (a frame is always tokens_per_frame tokens): no stop before this.
    min_tokens: int = 0


def sampling_support(
    sampling: SamplingParams, stop_ids: set[int], suppressed: Iterable[int] = ()
) -> dict[str, Any] | None:
    """The tokens ``sampling`` excludes beyond temperature/top-k/top-p, as JSON-able meta.

    Engines store it in ``meta["sampling_support"]``. The actor applies the same
    restriction (:func:`restrict_logits`) when it recomputes log-probs, so rollout and
    training log-probs, the PPO ratio and the KL all describe the distribution that
    was sampled from. ``suppressed`` are ids an engine never samples on its own account
    (a VLM's vision tokens, padded embedding rows): a short list where the allowed
    complement would hold the whole vocabulary. ``None`` when every token could be
    sampled at every step.
    """
    suppressed = sorted(set(suppressed))
    if sampling.allowed_token_ids is None and sampling.min_tokens == 0 and not suppressed:
        return None
    allowed = None
    if sampling.allowed_token_ids is not None:  # stop tokens stay allowed, as in the engines
        allowed = sorted({*sampling.allowed_token_ids, *stop_ids})
    return {
        "allowed_token_ids": allowed,
        "suppressed_token_ids": suppressed,
        "stop_token_ids": sorted(stop_ids),
        "min_tokens": sampling.min_tokens,
    }


def restrict_logits(logits: torch.Tensor, support: dict[str, Any] | None) -> torch.Tensor:
    """Response-step logits [b, T, V] with the tokens ``support`` excludes pushed to the
    dtype's minimum: outside ``allowed_token_ids`` or in ``suppressed_token_ids`` everywhere,
    stop tokens before ``min_tokens``. The minimum, not -inf, keeps entropies finite.
    """
    if not support:
        return logits
    steps, vocab = logits.shape[-2:]
    keep = torch.ones(steps, vocab, dtype=torch.bool, device=logits.device)
    if support["allowed_token_ids"] is not None:
        keep[:] = False
        keep[:, support["allowed_token_ids"]] = True
    if support.get("suppressed_token_ids"):
        keep[:, support["suppressed_token_ids"]] = False
    if support["min_tokens"]:
        keep[: support["min_tokens"], support["stop_token_ids"]] = False
    return logits.masked_fill(~keep, torch.finfo(logits.dtype).min)


def forced_steps(prompts: Any, max_tokens: int) -> torch.Tensor | None:
    """``prompts[FORCED_KEY]`` int64 [B, max_tokens] checked, or None when the batch forces
    nothing. Every row must force the same steps (a fixed layout, as world-model responses
    have)."""
    if FORCED_KEY not in prompts:
        return None
    forced = prompts[FORCED_KEY]
    if forced.shape[1] != max_tokens:
        raise ValueError(
            f"{FORCED_KEY} has {forced.shape[1]} steps but the rollout samples {max_tokens}: "
            "data.max_response_length must equal the processor's response length"
        )
    where = forced >= 0
    if not torch.equal(where, where[:1].expand_as(where)):
        raise ValueError(f"{FORCED_KEY}: rows force different steps; every row must force the same")
    return forced


def mask_forced(rollout: Any) -> Any:
    """Give a rollout's teacher-forced steps ``response_mask = 0`` and
    ``rollout_log_probs = 0``: they were written, not sampled, so they carry no log-prob and
    no loss. ``attention_mask`` keeps them: later steps attend to them."""
    if FORCED_KEY not in rollout:
        return rollout
    forced = rollout[FORCED_KEY] >= 0
    mismatch = forced & (rollout["responses"] != rollout[FORCED_KEY])
    if mismatch.any():
        row, step = (int(i) for i in mismatch.nonzero()[0])
        raise RuntimeError(f"sample {row}: the engine did not write forced step {step}")
    rollout["response_mask"] = rollout["response_mask"].masked_fill(forced, 0.0)
    rollout["rollout_log_probs"] = rollout["rollout_log_probs"].masked_fill(forced, 0.0)
    return rollout


def row_seeds(seed: int, rows: int, first_row: int = 0) -> torch.Tensor:
    """int64 [rows]: the sampling seed of rows ``first_row ..`` of a batch sampled with ``seed``.

    A row's seed depends on its own index only, so a response is the same whichever engine
    call, chunk or data-parallel rank samples it; hashing (seed, row) keeps neighbouring
    seeds' streams apart (``seed + row`` would give row r + 1 of one step the stream of
    row r of the next).
    """
    words = [
        np.random.SeedSequence([seed & 0xFFFFFFFFFFFFFFFF, row]).generate_state(2)
        for row in range(first_row, first_row + rows)
    ]
    values = [(int(w[0]) << 31 | int(w[1]) >> 1) & 0x7FFFFFFFFFFFFFFF for w in words]
    return torch.tensor(values, dtype=torch.int64)


def prompt_row_seeds(prompts: Any, sampling: SamplingParams) -> list[int] | None:
    """The per-row seeds a rollout of ``prompts`` samples with: the batch's own
    ``SEEDS_KEY`` field (set by the trainer over the whole batch before it is split), else
    :func:`row_seeds` of ``sampling.seed`` over this call's rows; None without a seed."""
    if SEEDS_KEY in prompts:
        return [int(s) for s in prompts[SEEDS_KEY]]
    if sampling.seed is None:
        return None
    return row_seeds(sampling.seed, len(prompts)).tolist()
