"""Rollout with transformers ``generate``."""

from __future__ import annotations

import torch
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from mmrl.models.responses import finish_rollout, generated_responses
from mmrl.protocol import Batch
from mmrl.rollout.base import register_rollout
from mmrl.sampling import SUPPORT_KEY, SamplingParams, sampling_support


@register_rollout("hf")
class HFRollout:
    """Samples from a transformers causal LM with ``generate``.

    The engine shares the actor's module, so it always samples from the current
    weights and needs no weight sync.
    """

    def __init__(
        self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, **_: object
    ) -> None:
        self.model = model
        self.eos_token_id = int(tokenizer.eos_token_id)
        self.pad_token_id = int(tokenizer.pad_token_id)

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Nothing to do: generation runs on the actor's own module."""

    @torch.no_grad()
    def generate(self, prompts: Batch, sampling: SamplingParams) -> Batch:
        if "multi_modal_inputs" in prompts:  # a VLM prompt batch (images, video, mrope positions)
            from mmrl.models.vlm import generate_vlm

            return generate_vlm(self.model, prompts, sampling, self.eos_token_id, self.pad_token_id)
        stop_ids = {self.eos_token_id, *sampling.stop_token_ids}
        config = GenerationConfig(
            max_new_tokens=sampling.max_tokens,
            min_new_tokens=sampling.min_tokens,
            do_sample=sampling.do_sample,
            temperature=sampling.temperature if sampling.do_sample else None,
            top_p=sampling.top_p if sampling.do_sample else None,
            top_k=sampling.top_k if sampling.do_sample else None,
            eos_token_id=sorted(stop_ids),
            pad_token_id=self.pad_token_id,
            output_scores=True,
            return_dict_in_generate=True,
        )
        was_training = self.model.training
        self.model.eval()
        with torch.random.fork_rng(devices=[]):
            if sampling.seed is not None:
                torch.manual_seed(sampling.seed)
            out = self.model.generate(
                input_ids=prompts["input_ids"],
                attention_mask=prompts["attention_mask"],
                generation_config=config,
                logits_processor=self._constraints(sampling),
            )
        self.model.train(was_training)

        responses, log_probs = generated_responses(
            out.sequences,
            out.scores,
            prompts["input_ids"].shape[1],
            sampling.max_tokens,
            self.pad_token_id,
        )
        out = finish_rollout(prompts, responses, log_probs, stop_ids, self.pad_token_id)
        out.meta[SUPPORT_KEY] = sampling_support(sampling, stop_ids)
        return out

    def _constraints(self, sampling: SamplingParams) -> LogitsProcessorList:
        if sampling.allowed_token_ids is None:
            return LogitsProcessorList()
        allowed = (
            set(sampling.allowed_token_ids) | set(sampling.stop_token_ids) | {self.eos_token_id}
        )
        return LogitsProcessorList([AllowedTokensProcessor(sorted(allowed))])


class AllowedTokensProcessor(LogitsProcessor):
    """Sets every logit outside ``allowed_token_ids`` to -inf, before temperature and top-k/p."""

    def __init__(self, allowed_token_ids: list[int]) -> None:
        self.allowed = torch.tensor(allowed_token_ids, dtype=torch.long)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        masked = torch.full_like(scores, float("-inf"))
        masked[:, self.allowed] = scores[:, self.allowed]
        return masked
