"""Supervised warm-up of a VLM: next-token cross-entropy on target responses, with the images.

Prompts go through the same :class:`~mmrl.processors.vision_prompts.VisionPromptProcessor`
as RL, targets are appended as right-padded "responses", and the loss is the mean
negative log-prob of the target tokens from
:func:`~mmrl.models.vlm.vlm_response_log_probs`: the very forward that
RL trains, so mrope positions and visual inputs are laid out the same way.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from mmrl.models.vlm import vlm_response_log_probs
from mmrl.models.vlm_inputs import extend_position_ids
from mmrl.protocol import Batch
from mmrl.tasks.sft import SFTConfig


def append_targets(prompts: Batch, targets: Sequence[str], tokenizer) -> Batch:
    """``prompts`` with each target (+ EOS) appended as a response.

    Adds ``responses`` and ``response_mask`` [B, T] (right-padded) and extends
    ``input_ids``/``attention_mask`` to [B, P + T] and ``position_ids`` to [B, 3, P + T].
    """
    rows = [
        tokenizer(str(t), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        for t in targets
    ]
    width = max(len(r) for r in rows)
    responses = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, r in enumerate(rows):
        responses[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1.0
    out = Batch(prompts.tensors.clone(), dict(prompts.non_tensor), dict(prompts.meta))
    out["input_ids"] = torch.cat([prompts["input_ids"], responses], dim=1)
    out["attention_mask"] = torch.cat([prompts["attention_mask"], mask.long()], dim=1)
    out["position_ids"] = extend_position_ids(prompts["position_ids"], width)
    out["responses"] = responses
    out["response_mask"] = mask
    return out


def sft_train_vlm(
    model: PreTrainedModel, batch: Batch, cfg: SFTConfig, seed: int, progress: bool = True
) -> list[float]:
    """Train ``model`` in place for ``cfg.steps`` steps on rows of ``batch`` (from
    :func:`append_targets`) drawn with replacement; returns the loss per step."""
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=cfg.lr, weight_decay=cfg.weight_decay
    )
    # Linear warm-up over the first 10% of steps, then cosine decay to zero.
    warmup = max(1, cfg.steps // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: min(
            (s + 1) / warmup,
            0.5 * (1 + math.cos(math.pi * max(0, s + 1 - warmup) / max(1, cfg.steps - warmup))),
        ),
    )
    rng = np.random.default_rng(seed)
    model.train()
    losses = []
    bar = tqdm(range(cfg.steps), desc="vlm sft warm-up", disable=not progress, leave=False)
    for _ in bar:
        mb = batch[rng.integers(0, len(batch), size=cfg.batch_size)]
        log_probs, _ = vlm_response_log_probs(model, mb)
        mask = mb["response_mask"]
        loss = -(log_probs * mask).sum() / mask.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    model.eval()
    return losses


def warm_up_vlm(
    model: PreTrainedModel,
    hf_processor,
    prompt_processor,
    dataset,
    targets: Sequence[str],
    cfg: SFTConfig,
    seed: int,
    progress: bool = True,
) -> dict[str, float]:
    """SFT ``model`` on (``dataset`` prompt with its images, target) pairs; returns ``sft/*``
    metrics.

    ``prompt_processor`` is the run's
    :class:`~mmrl.processors.vision_prompts.VisionPromptProcessor`,
    so prompts that the data limits filter out are dropped here too.
    """
    if cfg.steps <= 0:
        return {"sft/steps": 0}
    prompts = prompt_processor.encode_dataset(dataset, "train", extra={"sft_target": list(targets)})
    batch = append_targets(prompts, prompts["sft_target"], hf_processor.tokenizer)
    losses = sft_train_vlm(model, batch, cfg, seed, progress)
    return {
        "sft/steps": cfg.steps,
        "sft/batch_size": cfg.batch_size,
        "sft/final_loss": float(np.mean(losses[-10:])),
    }
