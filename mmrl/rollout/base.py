"""The rollout interface every engine implements, and the engine registry."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from mmrl.processors.vision_inputs import extend_position_ids
from mmrl.protocol import Batch


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


class RolloutEngine(Protocol):
    """A generation backend. Engines are built as
    ``engine_cls(model=actor_module, tokenizer=tokenizer, model_path=path, cfg=RolloutConfig,
    max_model_len=prompt + response length)`` and may ignore what they do not need.
    """

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Load the actor's current weights into the engine (after each update)."""
        ...

    def generate(self, prompts: Batch, sampling: SamplingParams) -> Batch:
        """Generate one response per row of ``prompts``.

        ``prompts`` holds left-padded ``input_ids``, ``attention_mask`` and
        ``position_ids`` [B, P]. The result adds ``responses`` [B, T] (right-padded),
        ``response_mask`` [B, T] (1 up to and including EOS), ``rollout_log_probs``
        [B, T], and extends ``input_ids``/``attention_mask``/``position_ids`` to
        [B, P + T]. ``meta["num_clipped"]`` counts responses that hit
        ``max_tokens`` without EOS; the per-sample flag is ``response_clipped`` [B].
        """
        ...


ROLLOUT_ENGINES: dict[str, Callable[..., RolloutEngine]] = {}
# Batch meta key under which engines record the token restrictions they sampled under.
SUPPORT_KEY = "sampling_support"


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
    return {"allowed_token_ids": allowed, "suppressed_token_ids": suppressed, "stop_token_ids": sorted(stop_ids),
            "min_tokens": sampling.min_tokens}


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


def register_rollout(name: str) -> Callable:
    def wrap(cls: Callable[..., RolloutEngine]) -> Callable[..., RolloutEngine]:
        ROLLOUT_ENGINES[name] = cls
        return cls

    return wrap


def get_rollout(name: str) -> Callable[..., RolloutEngine]:
    if name not in ROLLOUT_ENGINES:
        raise ValueError(f"unknown rollout engine {name!r}; registered: {sorted(ROLLOUT_ENGINES)}")
    return ROLLOUT_ENGINES[name]


def generated_responses(
    sequences: torch.Tensor, scores: tuple[torch.Tensor, ...], prompt_len: int, max_tokens: int, pad_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Responses [B, max_tokens] and their sampling log-probs from a transformers ``generate``.

    ``scores`` are the processed logits actually sampled from (temperature, top-k/top-p
    and constraints applied), so their log-softmax is the sampling log-prob. When every
    row stopped early, both are right-padded to a fixed width.
    """
    responses = sequences[:, prompt_len:]
    log_probs = torch.log_softmax(torch.stack(scores, dim=1).float(), dim=-1)
    log_probs = log_probs.gather(-1, responses.unsqueeze(-1)).squeeze(-1)
    pad = max_tokens - responses.shape[1]
    if pad > 0:
        responses = torch.nn.functional.pad(responses, (0, pad), value=pad_id)
        log_probs = torch.nn.functional.pad(log_probs, (0, pad), value=0.0)
    return responses, log_probs


def finish_rollout(
    prompts: Batch, responses: torch.Tensor, log_probs: torch.Tensor, eos_ids: set[int], pad_id: int
) -> Batch:
    """Mask everything after the first stop token and append responses to the prompts.

    Position ids continue after the prompt (:func:`extend_position_ids`): [B, P] for 1-D
    rope, [B, 3, P] for mrope. Non-tensor fields (``multi_modal_inputs``, ...) are carried
    by reference: the result's object arrays are new, their elements the prompts' own.

    Args:
        prompts: left-padded prompt batch, ``input_ids`` [B, P].
        responses: sampled token ids [B, T], any content after the stop token.
        log_probs: log-prob of each sampled token [B, T].
    """
    is_stop = torch.zeros_like(responses, dtype=torch.bool)
    for eos in eos_ids:
        is_stop |= responses == eos
    # A step is valid while no stop token came strictly before it.
    stops_before = torch.cumsum(is_stop.long(), dim=1) - is_stop.long()
    response_mask = (stops_before == 0).to(torch.float32)
    responses = torch.where(response_mask.bool(), responses, torch.full_like(responses, pad_id))
    # where(), not a product: a masked-out step may hold -inf (disallowed token after EOS).
    log_probs = torch.where(response_mask.bool(), log_probs, torch.zeros_like(log_probs))
    clipped = ~is_stop.any(dim=1)

    out = Batch(prompts.tensors.clone(), {k: v.copy() for k, v in prompts.non_tensor.items()}, dict(prompts.meta))
    out["input_ids"] = torch.cat([prompts["input_ids"], responses], dim=1)
    out["attention_mask"] = torch.cat([prompts["attention_mask"], response_mask.long()], dim=1)
    out["position_ids"] = extend_position_ids(prompts["position_ids"], responses.shape[1])
    out["responses"] = responses
    out["response_mask"] = response_mask
    out["rollout_log_probs"] = log_probs
    out["response_clipped"] = clipped
    out.meta["num_clipped"] = int(clipped.sum())
    return out
