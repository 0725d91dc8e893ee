"""The text LM family: a transformers causal LM whose steps are tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForTokenClassification,
    AutoTokenizer,
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
)

from mmrl import algos
from mmrl.models.decode import decode_rows
from mmrl.models.family import PolicyFamily, VLLMServing, register_family, torch_dtype
from mmrl.models.packing import head_on_positions, pack_rows
from mmrl.models.padding import trim_padding
from mmrl.models.prompt_sharing import shared_prompt_rows
from mmrl.models.responses import finish_rollout, generated_responses
from mmrl.models.row_sampling import seeded_sampling_processors
from mmrl.protocol import Batch
from mmrl.sampling import (
    SUPPORT_KEY,
    SamplingParams,
    forced_steps,
    mask_forced,
    restrict_logits,
    sampling_support,
)

MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids")


def has_vision_tower(path: Path) -> bool:
    """Whether the transformers config in ``path`` describes a vision tower (a VLM)."""
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    return getattr(config, "vision_config", None) is not None


@register_family("text_lm")
class TextLMFamily(PolicyFamily):
    """A ``save_pretrained`` causal LM with its tokenizer (Qwen2, Llama, ...)."""

    has_critic = True
    vllm_servable = True
    packs_rows = True
    # The transformers engine samples with mmrl.models.decode, which drops finished rows from
    # the forward pass; VLMs keep generate (their rope positions are 3-D).
    drops_finished_rows = True
    auto_class: Any = AutoModelForCausalLM

    def detect(self, path: Path) -> bool:
        return (path / "config.json").is_file() and not has_vision_tower(path)

    def describe(self) -> str:
        return "a transformers save_pretrained folder (config.json) with its tokenizer"

    def load(self, path: Path, dtype: str = "float32") -> nn.Module:
        return self.auto_class.from_pretrained(
            path, dtype=torch_dtype(dtype), local_files_only=True
        )

    def load_tokenizer(self, path: Path) -> Any:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)

    def save(
        self, model: nn.Module, path: Path, state_dict: dict[str, torch.Tensor], source: Path
    ) -> None:
        model.save_pretrained(path, state_dict=state_dict, safe_serialization=True)
        self.load_tokenizer(source).save_pretrained(path)

    def response_log_probs(
        self,
        model: nn.Module,
        batch: Batch,
        temperature: float = 1.0,
        with_entropy: bool = False,
        entropy_grad: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        responses = batch["responses"]
        # The logit at position i predicts token i + 1: the last T+1..1 positions score the
        # response, so the head runs on those alone (no prompt-position logits [b, P, V]).
        logits = model(
            **{k: batch[k] for k in MODEL_INPUTS},
            use_cache=False,
            logits_to_keep=responses.shape[1] + 1,
        ).logits
        logits = logits[:, :-1].float() / temperature
        return response_scores(logits, batch, with_entropy, entropy_grad)

    def packed_response_log_probs(
        self,
        model: nn.Module,
        batch: Batch,
        temperature: float = 1.0,
        with_entropy: bool = False,
        entropy_grad: bool = True,
        share_prompts: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        shared = shared_prompt_rows(batch) if share_prompts else None
        packed = shared or pack_rows(batch)
        if packed is None:
            return None
        inputs = {"input_ids": packed.input_ids, "position_ids": packed.position_ids}
        if shared is not None:
            inputs["attention_mask"] = shared.attention_mask
        with head_on_positions(model.get_output_embeddings(), packed.score_index):
            logits = model(**inputs, use_cache=False).logits[0]
        steps = packed.steps
        dense = logits.new_zeros(*steps.shape, logits.shape[-1], dtype=torch.float32)
        dense[steps] = logits.float() / temperature  # [b, T, V], as the padded path's
        log_probs, entropy = response_scores(dense, batch, with_entropy, entropy_grad)
        # Steps without a token were never computed: zeros, as trimmed steps are.
        zero = torch.zeros((), device=log_probs.device)
        log_probs = torch.where(steps, log_probs, zero)
        return log_probs, None if entropy is None else torch.where(steps, entropy, zero)

    def trim_padding(self, batch: Batch) -> Batch:
        return trim_padding(batch)

    @torch.no_grad()
    def generate(
        self, model: nn.Module, prompts: Batch, sampling: SamplingParams, tokenizer: Any
    ) -> Batch:
        eos_id, pad_id = int(tokenizer.eos_token_id), int(tokenizer.pad_token_id)
        stop_ids = {eos_id, *sampling.stop_token_ids}
        forced = forced_steps(prompts, sampling.max_tokens)
        processors = allowed_tokens(sampling, stop_ids)
        if forced is not None:  # last: it overrides every other restriction at forced steps
            processors.append(ForcedTokensProcessor(forced, prompts["input_ids"].shape[1]))
        sampler = None
        if sampling.do_sample:  # each row draws from its own seed; generate takes the draw
            warpers, sampler = seeded_sampling_processors(prompts, sampling)
            processors.extend(warpers)
        was_training = model.training
        model.eval()
        sample = decode_rows if self.drops_finished_rows else transformers_generate
        sequences, step_scores = sample(
            model,
            prompts["input_ids"],
            prompts["attention_mask"],
            processors,
            sampling.max_tokens,
            stop_ids,
            pad_id,
            sampling.min_tokens,
            keep_scores=sampler is None,
        )
        model.train(was_training)

        prompt_len = prompts["input_ids"].shape[1]
        scores = step_scores if sampler is None else sampler.scores
        responses, log_probs = generated_responses(
            sequences, scores, prompt_len, sampling.max_tokens, pad_id
        )
        out = mask_forced(finish_rollout(prompts, responses, log_probs, stop_ids, pad_id))
        out.meta[SUPPORT_KEY] = sampling_support(sampling, stop_ids)
        return out

    def load_critic(self, path: Path) -> nn.Module:
        # The caller seeds the fresh scalar head (every rank must draw the same one).
        # transformers puts a 0.1 dropout before the value head unless told otherwise: the
        # value targets would then be regressed through noise the rollout values lack.
        config = AutoConfig.from_pretrained(path, num_labels=1, local_files_only=True)
        config.classifier_dropout = 0.0
        return AutoModelForTokenClassification.from_pretrained(
            path, config=config, local_files_only=True
        )

    def values(self, critic: nn.Module, batch: Batch) -> torch.Tensor:
        num_steps = batch["responses"].shape[1]
        scores = critic(**{k: batch[k] for k in MODEL_INPUTS}, use_cache=False).logits
        return scores[:, -num_steps - 1 : -1, 0].float()

    def vllm_serving(self, path: Path, tokenizer: Any) -> VLLMServing:
        return VLLMServing()


def response_scores(
    logits: torch.Tensor, batch: Batch, with_entropy: bool, entropy_grad: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs [b, T] of ``batch["responses"]`` under ``logits`` [b, T, V] (already divided by
    the temperature), and their entropies [b, T] when asked (detached unless
    ``entropy_grad``: without an entropy bonus nothing differentiates them)."""
    # Under the same token restrictions the rollout sampled with (allowed ids, min length).
    logits = restrict_logits(logits, batch.meta.get(SUPPORT_KEY))
    log_probs = torch.log_softmax(logits, dim=-1).gather(-1, batch["responses"].unsqueeze(-1))
    entropy = None
    if with_entropy:
        entropy = algos.entropy_from_logits(logits if entropy_grad else logits.detach())
    return log_probs.squeeze(-1), entropy


def transformers_generate(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    processors: LogitsProcessorList,
    max_new_tokens: int,
    stop_ids: set[int],
    pad_id: int,
    min_new_tokens: int = 0,
    keep_scores: bool = True,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """:func:`~mmrl.models.decode.decode_rows`'s result from transformers' greedy
    ``generate``, which computes every row until the last one stops."""
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        min_new_tokens=min_new_tokens,
        do_sample=False,
        eos_token_id=sorted(stop_ids),
        pad_token_id=pad_id,
        output_scores=keep_scores,
        return_dict_in_generate=True,
    )
    out = model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        generation_config=config,
        logits_processor=processors,
    )
    return out.sequences, out.scores or ()


def allowed_tokens(sampling: SamplingParams, stop_ids: set[int]) -> LogitsProcessorList:
    """The ``generate`` logits processors for ``sampling.allowed_token_ids`` (stops allowed)."""
    if sampling.allowed_token_ids is None:
        return LogitsProcessorList()
    allowed = set(sampling.allowed_token_ids) | stop_ids
    return LogitsProcessorList([AllowedTokensProcessor(sorted(allowed))])


class AllowedTokensProcessor(LogitsProcessor):
    """Sets every logit outside ``allowed_token_ids`` to -inf, before temperature and top-k/p."""

    def __init__(self, allowed_token_ids: list[int]) -> None:
        self.allowed = torch.tensor(allowed_token_ids, dtype=torch.long)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        masked = torch.full_like(scores, float("-inf"))
        masked[:, self.allowed] = scores[:, self.allowed]
        return masked


class ForcedTokensProcessor(LogitsProcessor):
    """At a teacher-forced step, only the forced token keeps a (zero) logit: it is chosen
    whatever the temperature or top-k/p, with sampling log-prob 0.

    ``forced`` int64 [B, T] (-1 where the model samples); ``prompt_length`` P tells the step.
    """

    def __init__(self, forced: torch.Tensor, prompt_length: int) -> None:
        self.forced, self.prompt_length = forced, prompt_length

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        step = input_ids.shape[1] - self.prompt_length
        want = self.forced[:, step].to(scores.device)
        rows = (want >= 0).nonzero().squeeze(-1)
        if len(rows):
            scores = scores.clone()
            scores[rows] = float("-inf")
            scores[rows, want[rows]] = 0.0
        return scores
