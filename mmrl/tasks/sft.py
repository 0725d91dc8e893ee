"""Supervised warm-up: next-token cross-entropy on target responses only.

:func:`sft_initial_model` is a task's ``initial_model`` for a text model built from
config: warm it up, save it, report ``sft/*``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

if TYPE_CHECKING:
    from mmrl.config import RunConfig


@dataclass
class SFTConfig:
    """A fixed budget, set before RL and reported with the run."""

    steps: int = 600
    batch_size: int = 64
    lr: float = 3e-3
    weight_decay: float = 0.0


def encode_sft_pairs(
    tokenizer: PreTrainedTokenizerBase, prompts: Sequence[str], targets: Sequence[str]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``input_ids``, ``attention_mask`` and ``labels`` [N, L].

    Each row is prompt + target + EOS; labels are -100 on the prompt and padding
    so only the response is learned.
    """
    rows, label_rows = [], []
    for prompt, target in zip(prompts, targets, strict=True):
        p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        t = tokenizer(str(target), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        rows.append(p + t)
        label_rows.append([-100] * len(p) + t)
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (r, lab) in enumerate(zip(rows, label_rows, strict=True)):
        input_ids[i, : len(r)] = torch.tensor(r)
        labels[i, : len(r)] = torch.tensor(lab)
        mask[i, : len(r)] = 1
    return input_ids, mask, labels


def sft_train(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[str],
    targets: Sequence[str],
    cfg: SFTConfig,
    seed: int,
    progress: bool = True,
) -> list[float]:
    """Train ``model`` in place for ``cfg.steps`` steps; returns the loss per step."""
    if len(prompts) == 0:
        raise ValueError("SFT warm-up got an empty dataset")
    input_ids, mask, labels = encode_sft_pairs(tokenizer, prompts, targets)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / max(1, cfg.steps // 10))
    )
    rng = np.random.default_rng(seed)
    model.train()
    losses = []
    bar = tqdm(range(cfg.steps), desc="sft warm-up", disable=not progress, leave=False)
    for _ in bar:
        idx = torch.from_numpy(rng.integers(0, len(input_ids), size=cfg.batch_size))
        out = model(input_ids=input_ids[idx], attention_mask=mask[idx], labels=labels[idx])
        optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(out.loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    return losses


def sft_initial_model(
    cfg: RunConfig,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[str],
    targets: Sequence[str],
    sft: SFTConfig,
) -> tuple[Path, dict[str, float]]:
    """Warm ``model`` up on (prompt, target) pairs and save it with its tokenizer under
    ``<output_dir>/init_model``; returns the folder and the ``sft/*`` metrics."""
    losses = sft_train(
        model, tokenizer, prompts, targets, sft, cfg.trainer.seed, cfg.trainer.progress_bar
    )
    path = cfg.output_dir / "init_model"
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path, {
        "sft/steps": sft.steps,
        "sft/final_loss": float(np.mean(losses[-10:])) if losses else float("nan"),
    }
