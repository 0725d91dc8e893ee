"""A synthetic text task with a checkable answer: ``"23+41="`` -> ``"64"``.

The model is a tiny Qwen2 over a character vocabulary, built from config and
warmed up with a short SFT run so that GRPO starts with a learning signal.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from mmrl.errors import ConfigError
from mmrl.tasks.base import PromptDataset, Task, TaskData, register_task, task_config
from mmrl.tasks.sft import SFTConfig, sft_initial_model

if TYPE_CHECKING:
    from mmrl.config import RunConfig

CHARS = list("0123456789+-*= ")
SPECIAL = {"pad": "<pad>", "eos": "<eos>", "bos": "<bos>"}


@dataclass
class TextAdditionConfig:
    name: str = "text_addition"
    max_operand: int = 49
    train_size: int = 4000
    val_size: int = 256
    # Problems held out for final claims only (TaskData.test); 0: no test split.
    test_size: int = 0
    model: dict[str, Any] = field(default_factory=dict)
    sft: SFTConfig = field(default_factory=SFTConfig)


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer; saved and reloaded with ``save_pretrained``."""
    vocab = {
        tok: i for i, tok in enumerate([SPECIAL["pad"], SPECIAL["eos"], SPECIAL["bos"], *CHARS])
    }
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=SPECIAL["pad"]))
    core.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=SPECIAL["pad"],
        eos_token=SPECIAL["eos"],
        bos_token=SPECIAL["bos"],
        clean_up_tokenization_spaces=False,
    )


@register_task("text_addition")
class TextAdditionTask(Task[PromptDataset]):
    def __init__(self, cfg: dict[str, Any]) -> None:
        self.cfg: TextAdditionConfig = task_config(TextAdditionConfig, cfg)
        self.name = self.cfg.name

    def build_data(self, seed: int) -> TaskData[PromptDataset]:
        """Disjoint train, validation and (with ``test_size``) test problem sets, drawn with
        ``seed``."""
        n = self.cfg.max_operand + 1
        pairs = [(a, b) for a in range(n) for b in range(n)]
        random.Random(seed).shuffle(pairs)
        val_end = self.cfg.val_size
        test_end = val_end + self.cfg.test_size
        val_pairs, test_pairs, train_pool = (
            pairs[:val_end],
            pairs[val_end:test_end],
            pairs[test_end:],
        )
        if not train_pool:
            raise ConfigError(
                f"task.val_size={self.cfg.val_size} and task.test_size={self.cfg.test_size} leave "
                f"no training problems out of {len(pairs)}"
            )
        rng = random.Random(seed + 1)
        train_pairs = [rng.choice(train_pool) for _ in range(self.cfg.train_size)]
        test = self._dataset(test_pairs) if test_pairs else None
        return TaskData(train=self._dataset(train_pairs), val=self._dataset(val_pairs), test=test)

    @staticmethod
    def _dataset(pairs: list[tuple[int, int]]) -> PromptDataset:
        return PromptDataset(
            prompts=[f"{a}+{b}=" for a, b in pairs],
            ground_truth=[str(a + b) for a, b in pairs],
        )

    def initial_model(self, cfg: RunConfig) -> tuple[Path, dict[str, float]]:
        """The tiny Qwen2 from config after the SFT warm-up (``task.sft``) on the training
        problems."""
        tokenizer = build_char_tokenizer()
        model = self.build_model(tokenizer)
        train = self.build_data(cfg.trainer.seed).train
        return sft_initial_model(
            cfg, model, tokenizer, train.prompts, train.ground_truth, self.cfg.sft
        )

    def build_model(self, tokenizer: PreTrainedTokenizerFast) -> Qwen2ForCausalLM:
        arch = {
            "hidden_size": 64,
            "intermediate_size": 256,
            "num_hidden_layers": 2,
            "num_attention_heads": 1,
            "num_key_value_heads": 1,
            "tie_word_embeddings": False,
            **self.cfg.model,
        }
        config = Qwen2Config(
            vocab_size=len(tokenizer),
            max_position_embeddings=128,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            bos_token_id=tokenizer.bos_token_id,
            **arch,
        )
        return Qwen2ForCausalLM(config)
