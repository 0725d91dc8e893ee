"""The token world model's vocabulary: special, visual and action tokens in one id space.

Layout (ids ascending)::

    [0, 5)                 special: <pad>=0 <eos>=1 <bos>=2 <frame>=3 <action>=4
    [5, 5+K)               visual: VQ code k is id 5+k
    [5+K, 5+K+M)           action: discrete action a is id 5+K+a (M = num_actions);
                           continuous dim d in bin b is id 5+K+d*bins+b (M = dim*bins)

Continuous actions are quantised per dimension into ``bins`` equal bins over
``[low, high]`` (values outside are clipped); a bin decodes to its centre.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from mmrl.worldmodel.envs import ActionSpec

SPECIAL_TOKENS = ("<pad>", "<eos>", "<bos>", "<frame>", "<action>")
PAD, EOS, BOS, FRAME, ACTION = range(len(SPECIAL_TOKENS))
LAYOUT_FILE = "worldmodel_layout.json"


@dataclass(frozen=True)
class VocabLayout:
    """Where each kind of token lives; ``grid`` is the tokenizer's ``(h, w)`` per frame."""

    codebook_size: int
    grid: tuple[int, int]
    action: ActionSpec
    action_bins: int = 9

    def __post_init__(self) -> None:
        if self.codebook_size < 2:
            raise ValueError(f"codebook_size must be >= 2, found {self.codebook_size}")
        if len(self.grid) != 2 or min(self.grid) < 1:
            raise ValueError(f"grid must be (h, w) with h, w >= 1, found {self.grid}")
        if self.action.kind == "continuous" and self.action_bins < 2:
            raise ValueError(f"continuous actions need action_bins >= 2, found {self.action_bins}")
        object.__setattr__(self, "grid", tuple(int(g) for g in self.grid))

    @property
    def visual_offset(self) -> int:
        return len(SPECIAL_TOKENS)

    @property
    def action_offset(self) -> int:
        return self.visual_offset + self.codebook_size

    @property
    def num_action_tokens(self) -> int:
        if self.action.kind == "discrete":
            return self.action.num_actions
        return self.action.dim * self.action_bins

    @property
    def vocab_size(self) -> int:
        return self.action_offset + self.num_action_tokens

    @property
    def tokens_per_frame(self) -> int:
        return self.grid[0] * self.grid[1]

    @property
    def tokens_per_action(self) -> int:
        return self.action.dim

    def visual_ids(self) -> list[int]:
        """Every visual token id (the allowed ids when generating frames)."""
        return list(range(self.visual_offset, self.action_offset))

    def codes_to_ids(self, codes: np.ndarray) -> np.ndarray:
        """VQ codes ``[..., h, w]`` -> visual ids ``[..., h*w]`` (row-major)."""
        codes = np.asarray(codes, dtype=np.int64)
        if codes.shape[-2:] != self.grid:
            raise ValueError(
                f"expected codes [..., {self.grid[0]}, {self.grid[1]}], found {list(codes.shape)}"
            )
        if codes.size and (codes.min() < 0 or codes.max() >= self.codebook_size):
            raise ValueError(
                f"codes must be in [0, {self.codebook_size}), found [{codes.min()}, {codes.max()}]"
            )
        return codes.reshape(*codes.shape[:-2], self.tokens_per_frame) + self.visual_offset

    def action_to_ids(self, actions: np.ndarray) -> np.ndarray:
        """Actions ``float [N, A]`` -> action ids ``int64 [N, A]`` (one token per dim)."""
        actions = np.asarray(actions, dtype=np.float64)
        self.action.check(actions.astype(np.float32), "action_to_ids")
        if self.action.kind == "discrete":
            return actions.astype(np.int64) + self.action_offset
        low, high, bins = self.action.low, self.action.high, self.action_bins
        b = np.clip(np.floor((actions - low) / (high - low) * bins), 0, bins - 1).astype(np.int64)
        return self.action_offset + np.arange(self.action.dim) * bins + b

    def ids_to_action(self, ids: np.ndarray) -> np.ndarray:
        """Action ids ``[N, A]`` -> ``float32 [N, A]`` (discrete ids, or bin centres)."""
        rel = np.asarray(ids, dtype=np.int64) - self.action_offset
        if self.action.kind == "discrete":
            return rel.astype(np.float32)
        b = rel - np.arange(self.action.dim) * self.action_bins
        width = (self.action.high - self.action.low) / self.action_bins
        return (self.action.low + (b + 0.5) * width).astype(np.float32)

    def token_names(self) -> list[str]:
        """A readable name for every id, in id order."""
        names = list(SPECIAL_TOKENS) + [f"<v{k}>" for k in range(self.codebook_size)]
        if self.action.kind == "discrete":
            return names + [f"<a{a}>" for a in range(self.action.num_actions)]
        return names + [
            f"<a{d}_{b}>" for d in range(self.action.dim) for b in range(self.action_bins)
        ]

    def to_json(self) -> dict[str, Any]:
        return {
            "codebook_size": self.codebook_size,
            "grid": list(self.grid),
            "action": self.action.to_json(),
            "action_bins": self.action_bins,
            "special_tokens": list(SPECIAL_TOKENS),
            "vocab_size": self.vocab_size,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> VocabLayout:
        if data.get("special_tokens", list(SPECIAL_TOKENS)) != list(SPECIAL_TOKENS):
            raise ValueError(
                f"layout special tokens {data['special_tokens']} differ from {list(SPECIAL_TOKENS)}"
            )
        layout = cls(
            codebook_size=int(data["codebook_size"]),
            grid=tuple(data["grid"]),
            action=ActionSpec.from_json(data["action"]),
            action_bins=int(data["action_bins"]),
        )
        if "vocab_size" in data and data["vocab_size"] != layout.vocab_size:
            raise ValueError(
                f"layout says vocab_size {data['vocab_size']}, its parts add up to "
                f"{layout.vocab_size}"
            )
        return layout

    def save(self, path: str | Path) -> None:
        (Path(path) / LAYOUT_FILE).write_text(json.dumps(self.to_json(), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> VocabLayout:
        file = Path(path) / LAYOUT_FILE
        if not file.exists():
            raise FileNotFoundError(f"no {LAYOUT_FILE} in {path}: not a token world model")
        return cls.from_json(json.loads(file.read_text()))


def build_hf_tokenizer(layout: VocabLayout) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over the layout's token names, so HF and vLLM can load the model dir.

    Prompts are built as ids by the processor; this tokenizer only names ids
    (``decode``) and supplies the special token ids.
    """
    vocab = {name: i for i, name in enumerate(layout.token_names())}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=SPECIAL_TOKENS[PAD]))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=SPECIAL_TOKENS[PAD],
        eos_token=SPECIAL_TOKENS[EOS],
        bos_token=SPECIAL_TOKENS[BOS],
        additional_special_tokens=list(SPECIAL_TOKENS[FRAME:]),
        clean_up_tokenization_spaces=False,
    )
