"""Text processor: prompts to left-padded token tensors, responses back to text."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from mmrl.errors import DataError
from mmrl.protocol import Batch


class PromptDataLike(Protocol):
    prompts: Sequence[str]
    ground_truth: Sequence[Any]
    extra_info: Sequence[dict]

    def __len__(self) -> int: ...


class PromptTooLongError(DataError):
    """A prompt does not fit ``data.max_prompt_length``."""


@dataclass
class TextProcessor:
    """Owns the token layout of text prompts and responses.

    Prompts are left-padded to ``max_prompt_length`` so that every response
    starts at the same column, and responses are right-padded by the rollout.
    """

    tokenizer: PreTrainedTokenizerBase
    max_prompt_length: int
    filter_overlong: bool = False

    @property
    def pad_token_id(self) -> int:
        return int(self.tokenizer.pad_token_id)

    @property
    def eos_token_id(self) -> int:
        return int(self.tokenizer.eos_token_id)

    def encode_prompts(
        self,
        prompts: Sequence[str],
        non_tensor: dict[str, Sequence] | None = None,
        sample_ids: Sequence[int] | None = None,
    ) -> Batch:
        """Tokenize ``prompts`` into ``input_ids``, ``attention_mask``, ``position_ids`` [B, P].

        A prompt longer than ``max_prompt_length`` raises :class:`PromptTooLongError`
        naming the sample, or is dropped when ``filter_overlong`` is set (the count
        goes to ``meta["num_filtered_prompts"]``).
        """
        if len(prompts) == 0:
            raise ValueError("no prompts to encode: the dataset or batch is empty")
        sample_ids = list(range(len(prompts))) if sample_ids is None else list(sample_ids)
        encoded = [self.tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
        keep = []
        for i, ids in enumerate(encoded):
            if len(ids) <= self.max_prompt_length:
                keep.append(i)
            elif not self.filter_overlong:
                raise PromptTooLongError(
                    f"sample {sample_ids[i]}: prompt has {len(ids)} tokens, more than "
                    f"data.max_prompt_length={self.max_prompt_length} (prompt: "
                    f"{prompts[i][:80]!r}); "
                    "raise the limit or set data.filter_overlong_prompts=true"
                )
        if not keep:
            raise PromptTooLongError(f"all {len(prompts)} prompts exceed max_prompt_length")
        width = self.max_prompt_length
        input_ids = torch.full((len(keep), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(keep), width), dtype=torch.long)
        for row, i in enumerate(keep):
            ids = encoded[i]
            input_ids[row, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
            attention_mask[row, width - len(ids) :] = 1
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        fields = {k: np.asarray(v, dtype=object)[keep] for k, v in (non_tensor or {}).items()}
        fields["raw_prompt"] = np.asarray(list(prompts), dtype=object)[keep]
        return Batch.from_dict(
            tensors={
                "input_ids": input_ids,
                "attention_mask": attention_mask,
                "position_ids": position_ids,
            },
            non_tensor=fields,
            meta={"num_filtered_prompts": len(prompts) - len(keep)},
        )

    def encode_dataset(self, dataset: PromptDataLike, split: str) -> Batch:
        """A task's prompts with their ground truths and extra info (non-tensor fields)."""
        if len(dataset) == 0:
            raise DataError(f"the {split} dataset is empty: check the task's {split} size settings")
        return self.encode_prompts(
            dataset.prompts,
            {"ground_truth": dataset.ground_truth, "extra_info": dataset.extra_info},
        )

    def decode(self, batch: Batch) -> Batch:
        """Add ``response_text``, the decoded responses that text verifiers read."""
        texts = self.decode_responses(batch["responses"], batch["response_mask"])
        batch["response_text"] = np.asarray(texts, dtype=object)
        return batch

    def sampling_overrides(self) -> dict[str, Any]:
        """Text responses are free-form: no constraint on the sampler."""
        return {}

    def decode_responses(self, responses: torch.Tensor, response_mask: torch.Tensor) -> list[str]:
        """Decode ``responses`` [B, T] up to their mask, without the EOS token."""
        texts = []
        for ids, mask in zip(responses.tolist(), response_mask.tolist(), strict=True):
            valid = [t for t, m in zip(ids, mask, strict=True) if m and t != self.eos_token_id]
            texts.append(self.tokenizer.decode(valid, skip_special_tokens=True))
        return texts
