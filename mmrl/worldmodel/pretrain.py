"""``mmrl pretrain-worldmodel``: data, tokenizer, then MLE pretraining of the token world model.

Data is generated from a registered environment (``data.env``), or imported from a
folder of recorded videos (``data.videos``; see :mod:`mmrl.worldmodel.video_import`).

Outputs in ``output_dir``: ``data/{train,val[,test]}`` (trajectory datasets), ``tokenizer/``
(VQ tokenizer), ``token_wm/best`` and ``token_wm/last`` (checkpoints, loadable with
:func:`~mmrl.worldmodel.token_lm.load_token_world_model`), ``pretrain_metrics.jsonl``
(one line per validation) and ``pretrain_summary.json``.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from mmrl.utils.seed import set_seed
from mmrl.utils.timing import peak_rss_gib
from mmrl.worldmodel.data import TrajectoryDataset
from mmrl.worldmodel.envs import frame_state_match, make_env
from mmrl.worldmodel.frames import psnr
from mmrl.worldmodel.lm_init import initial_model
from mmrl.worldmodel.pretrain_config import (
    LMTrainSection,
    PretrainConfig,
    load_pretrain_config,
)
from mmrl.worldmodel.pretrain_data import (
    IGNORE,
    changed_tokens,
    encode_sequences,
    prepare_data,
    video_keys,
)
from mmrl.worldmodel.token_lm import (
    TokenWorldModelProcessor,
    load_token_world_model,
    save_token_world_model,
)
from mmrl.worldmodel.tokenizer import VQTokenizer, train_vq_tokenizer
from mmrl.worldmodel.vocab import VocabLayout

logger = logging.getLogger(__name__)


@dataclass
class PretrainResult:
    output_dir: Path
    best_dir: Path
    stop_reason: str
    steps_run: int
    best_val_loss: float
    summary: dict[str, Any]


@torch.no_grad()
def response_loss(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    processor: TokenWorldModelProcessor,
    batch_size: int = 64,
) -> float:
    """Mean next-token cross-entropy over the response's visual tokens only (nats per token;
    an interleaved response's forced actions are not predictions)."""
    model.eval()
    steps = torch.from_numpy(processor.response_visual_mask())
    length = len(steps)
    total = 0.0
    for s in range(0, len(input_ids), batch_size):
        ids = input_ids[s : s + batch_size]
        logits = model(input_ids=ids).logits[:, -length - 1 : -1][:, steps]
        target = ids[:, -length:][:, steps]
        total += torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), target.flatten(), reduction="sum"
        ).item()
    model.train()
    return total / (len(input_ids) * int(steps.sum()))


@torch.no_grad()
def greedy_responses(
    model: PreTrainedModel,
    prompts: torch.Tensor,
    processor: TokenWorldModelProcessor,
    forced: torch.Tensor | None = None,
) -> torch.Tensor:
    """Greedy responses ``[B, response_length]`` constrained to visual tokens (all prompts have
    one length); ``forced int64 [B, response_length]`` (interleaved: the actions, ``FREE``
    elsewhere) is written where it is not ``FREE``."""
    allowed = torch.zeros(model.config.vocab_size, dtype=torch.bool)
    allowed[processor.allowed_token_ids()] = True
    model.eval()
    ids = prompts
    past = None
    out = []
    for step in range(processor.response_length):
        result = model(input_ids=ids, past_key_values=past, use_cache=True)
        past = result.past_key_values
        logits = result.logits[:, -1].masked_fill(~allowed, float("-inf"))
        ids = logits.argmax(-1, keepdim=True)
        if forced is not None:
            ids = torch.where(forced[:, step : step + 1] >= 0, forced[:, step : step + 1], ids)
        out.append(ids)
    model.train()
    return torch.cat(out, dim=1)


def pretrain_token_world_model(cfg: PretrainConfig) -> PretrainResult:
    """Data, tokenizer, then next-token MLE with validation, checkpoints and a plateau stop."""
    start = time.perf_counter()
    set_seed(cfg.seed)
    out = Path(cfg.output_dir)
    train_dir, val_dir, _ = prepare_data(cfg)  # the test split stays unseen until the end
    out.mkdir(parents=True, exist_ok=True)
    tok = train_vq_tokenizer(
        train_dir,
        cfg.tokenizer.dir,
        cfg=cfg.tokenizer.model,
        train=cfg.tokenizer.train,
        progress=cfg.progress_bar,
    )
    action = TrajectoryDataset(train_dir).info.action
    layout = VocabLayout(tok.codebook_size, tok.grid, action, cfg.action_bins)
    processor = TokenWorldModelProcessor(
        layout, cfg.data.context, cfg.data.future, cfg.data.action_form
    )
    train_ids, train_labels = encode_sequences(train_dir, tok, processor)
    val_ids, _ = encode_sequences(val_dir, tok, processor)
    val_ids = val_ids[
        torch.randperm(len(val_ids), generator=torch.Generator().manual_seed(cfg.seed))
    ]
    model = initial_model(processor, cfg)
    logger.info(
        "token world model: %.2fM params, %d train / %d held-out sequences of %d tokens",
        sum(p.numel() for p in model.parameters()) / 1e6,
        len(train_ids),
        len(val_ids),
        train_ids.shape[1],
    )
    stop_reason, steps_run, history = _train_loop(
        model, processor, train_ids, train_labels, val_ids, cfg, out
    )
    best_dir = out / "token_wm" / "best"
    summary = {
        "stop_reason": stop_reason,
        "steps_run": steps_run,
        "step_budget": cfg.train.steps,
        "best_val_loss": min(h["val/loss"] for h in history),
        "best_step": min(history, key=lambda h: h["val/loss"])["step"],
        "tokenizer_psnr": json.loads((Path(cfg.tokenizer.dir) / "mmrl_cache.json").read_text())[
            "psnr"
        ],
        **evaluate_greedy(best_dir, tok, val_dir, processor, cfg.train.eval_windows, cfg.seed),
        "train_sequences": len(train_ids),
        "val_sequences": len(val_ids),
        "wall_time_s": time.perf_counter() - start,
        "peak_memory_gib": peak_rss_gib(),
        "config": asdict(cfg),
        "video_keys": video_keys(cfg),  # a changed video folder invalidates this run
    }
    (out / "pretrain_summary.json").write_text(json.dumps(summary, indent=1))
    return PretrainResult(out, best_dir, stop_reason, steps_run, summary["best_val_loss"], summary)


def below_copying(summary: dict[str, Any], lr: float, prefix: str = "") -> str | None:
    """One line when the greedy held-out next frame is worse than copying the last frame.

    RL from such a base mostly learns to stand still (docs/benchmarks.md), so the summary
    says it before RL starts; ``prefix`` is where the pretraining keys sit in the overrides
    that the line suggests. At lr 2e-3, whether the base got past copying varied with the
    seed; 1e-3 (the default) did on every recording set measured, so the line suggests
    halving ``lr`` from there (docs/benchmarks.md, "The one-frame pretraining over seeds").
    """
    model, copied = summary["val/psnr_greedy"], summary["val/psnr_copy_last_frame"]
    if not model < copied:
        return None
    lower = 1e-3 if lr > 1e-3 else lr / 2
    return (
        f"the pretrained model's greedy next frame is below copying the last frame on held-out "
        f"windows ({model:.2f} against {copied:.2f} dB PSNR; best val loss "
        f"{summary['best_val_loss']:.4f} at step {summary['best_step']}); RL from it tends to "
        f"learn to stand still. A longer {prefix}train.steps, {prefix}train.lr={lower:g} or "
        f"another seed can get past it (docs/worldmodel.md)"
    )


def lr_factor(t: LMTrainSection, step: int) -> float:
    """Linear warm-up, then a cosine from 1 down to ``min_lr_ratio`` at the step budget."""
    if step < t.warmup_steps:
        return (step + 1) / t.warmup_steps
    done = (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps)
    return t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, done)))


def weighted_lm_loss(
    model: PreTrainedModel, ids: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """Next-token cross-entropy on the labelled ids, a weighted mean with ``weights [B, L]``
    (all ones: the model's own mean loss)."""
    logits = model(input_ids=ids).logits[:, :-1]
    target, w = labels[:, 1:], weights[:, 1:] * (labels[:, 1:] != IGNORE)
    ce = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), target.flatten(), ignore_index=IGNORE, reduction="none"
    )
    return (ce * w.flatten()).sum() / w.sum()


def plateaued(val_losses: list[float], patience: int, min_delta: float) -> bool:
    """True when none of the last ``patience`` losses beat the best before them by ``min_delta``."""
    if patience < 1 or len(val_losses) <= patience:
        return False
    best_before = min(val_losses[:-patience])
    return min(val_losses[-patience:]) > best_before - min_delta


def _train_loop(
    model: PreTrainedModel,
    processor: TokenWorldModelProcessor,
    train_ids: torch.Tensor,
    train_labels: torch.Tensor,
    val_ids: torch.Tensor,
    cfg: PretrainConfig,
    out: Path,
) -> tuple[str, int, list[dict[str, float]]]:
    """AdamW with linear warm-up; validate every ``val_every`` steps, keep the best, stop on a
    plateau.

    Returns the stop reason, the steps run and the validation history.
    """
    t = cfg.train
    optimizer = torch.optim.AdamW(model.parameters(), lr=t.lr, weight_decay=t.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, partial(lr_factor, t))
    rng = np.random.default_rng(cfg.seed)
    val_ids = val_ids[: t.val_windows]
    history: list[dict[str, float]] = []
    stop_reason, step = "budget", 0
    metrics_file = (out / "pretrain_metrics.jsonl").open("w")
    bar = tqdm(
        range(1, t.steps + 1), desc="pretrain token world model", disable=not cfg.progress_bar
    )
    model.train()
    weights = 1.0 + (t.change_weight - 1.0) * changed_tokens(train_ids, processor).float()
    for step in bar:
        idx = torch.from_numpy(rng.integers(0, len(train_ids), t.batch_size))
        loss = weighted_lm_loss(model, train_ids[idx], train_labels[idx], weights[idx])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if step % t.val_every and step != t.steps:
            bar.set_postfix(loss=f"{loss.item():.3f}")
            continue
        val = response_loss(model, val_ids, processor)
        history.append({"step": step, "train/loss": loss.item(), "val/loss": val})
        metrics_file.write(json.dumps(history[-1]) + "\n")
        metrics_file.flush()
        bar.set_postfix(loss=f"{loss.item():.3f}", val=f"{val:.3f}")
        if val == min(h["val/loss"] for h in history):
            save_token_world_model(model, processor, out / "token_wm" / "best")
        if step < t.steps and plateaued([h["val/loss"] for h in history], t.patience, t.min_delta):
            stop_reason = f"plateau: no val improvement > {t.min_delta} in {t.patience} validations"
            break
    metrics_file.close()
    save_token_world_model(model, processor, out / "token_wm" / "last")
    return stop_reason, step, history


def evaluate_greedy(
    model_dir: Path,
    tok: VQTokenizer,
    val_dir: Path,
    processor: TokenWorldModelProcessor,
    n: int,
    seed: int,
) -> dict[str, float]:
    """Greedy next-frame scores on ``n`` held-out windows, beside two references.

    ``copy_last_frame`` predicts the last context frame through the tokenizer
    (the trivial world model in token space); ``tokenizer_ceiling`` decodes the true
    future's own tokens. ``state_match`` is the fraction of predicted frames whose
    environment state, read by the renderer's inverse, equals the true one.
    """
    from mmrl.worldmodel.data import WindowDataset

    model, processor = load_token_world_model(model_dir)
    data = TrajectoryDataset(val_dir)
    windows = WindowDataset(data, processor.context, processor.future)
    pick = np.random.default_rng(seed).permutation(len(windows))[:n]
    items = [windows[int(i)] for i in pick]
    prompts = torch.tensor(
        [processor.build_prompt(tok.encode(w.context), w.actions) for w in items]
    )
    forced = torch.from_numpy(np.stack([processor.forced_response(w.actions) for w in items]))
    frames, valid, _ = processor.decode_frames(
        greedy_responses(model, prompts, processor, forced).tolist(), tok
    )
    shape = (-1, *frames.shape[2:])
    truth = np.stack([w.future for w in items]).reshape(shape)
    last = np.stack([np.repeat(w.context[-1:], processor.future, axis=0) for w in items])
    copied = tok.decode(tok.encode(last.reshape(shape)))
    ceiling = tok.decode(tok.encode(truth))
    env = make_env(data.info.env, **data.index["env_config"]) if data.info.env else None
    scores: dict[str, float] = {"val/valid_fraction": float(valid.mean())}
    for name, pred in (("greedy", frames.reshape(shape)), ("copy_last_frame", copied),
                       ("tokenizer_ceiling", ceiling)):  # fmt: skip
        scores[f"val/psnr_{name}"] = psnr(pred, truth)
        if env is None:  # recorded video: no renderer to read a state from
            scores[f"val/state_match_{name}"] = float("nan")
            continue
        matches = [frame_state_match(env, p, t)[0] for p, t in zip(pred, truth, strict=True)]
        scores[f"val/state_match_{name}"] = float(np.mean(matches))
    return scores


def main(overrides: list[str]) -> int:
    """Entry point of ``mmrl pretrain-worldmodel``; prints the summary."""
    cfg = load_pretrain_config(overrides)
    result = pretrain_token_world_model(cfg)
    s = result.summary
    print(f"\npretraining finished: {result.output_dir}")
    print(
        f"  stopped:          {s['stop_reason']} after {s['steps_run']} of {s['step_budget']} steps"
    )
    print(f"  best val loss:    {s['best_val_loss']:.4f} nats/token at step {s['best_step']}")
    print(f"  tokenizer PSNR:   {s['tokenizer_psnr']:.2f} dB (training frames)")
    print("  held-out next frame, greedy:   PSNR dB   state match")
    for name in ("greedy", "copy_last_frame", "tokenizer_ceiling"):
        print(f"    {name:<27} {s[f'val/psnr_{name}']:7.2f}   {s[f'val/state_match_{name}']:8.3f}")
    if (warning := below_copying(s, cfg.train.lr)) is not None:
        print(f"  warning:          {warning}")
    print(f"  checkpoint:       {result.best_dir} (save_pretrained)")
    print(
        f"  wall time:        {s['wall_time_s']:.1f} s, peak memory {s['peak_memory_gib']:.2f} GiB"
    )
    return 0
