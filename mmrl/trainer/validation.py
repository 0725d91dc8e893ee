"""Validation: held-out prompts, ``rollout.val_kwargs.n`` samples each, scored by the validation
verifiers (``reward.val_verifiers``, by default the training ones).

Metrics: ``val/*`` (the mean score and each verifier's means over all samples) and, from the
same samples, verl's ``val-core/<task>/reward/mean@N``, ``best@N``, ``maj@N`` (text answers)
and ``val-aux/...`` (``std@N``, ``worst@N``, smaller N, each verifier's own score), see
:mod:`mmrl.trainer.val_metrics`. World-model runs also return a frame strip per validation
(``val/frames``: last context frame | true future | predicted future, one row per prompt).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from mmrl.config import RunConfig
from mmrl.hybrid import WorkerGroup
from mmrl.processors.base import PromptProcessor
from mmrl.protocol import Batch
from mmrl.trainer.experience import apply_scores, sampling_params, with_row_seeds
from mmrl.trainer.val_metrics import validation_metrics
from mmrl.verifiers import VerifierRunner
from mmrl.verifiers.reasoning import extract_answer

STRIP_ROWS = 4  # prompts shown in a validation frame strip
STRIP_SCALE = 3  # pixels per frame pixel, so that small frames are visible


def build_val_runner(cfg: RunConfig, train_runner: VerifierRunner) -> VerifierRunner:
    """The runner of ``reward.val_verifiers``, or ``train_runner`` when it is null."""
    if cfg.reward.val_verifiers is None:
        return train_runner
    return VerifierRunner(cfg.reward.val_verifiers, cfg.reward.num_workers, cfg.reward.timeout_s)


def validate(
    cfg: RunConfig,
    val_prompts: Batch,
    worker: WorkerGroup,
    processor: PromptProcessor,
    runner: VerifierRunner,
    greedy: bool = False,
    record: Callable[[Batch, int], None] | None = None,
) -> tuple[dict[str, float], dict[str, np.ndarray]]:
    """Score held-out prompts with ``rollout.val_kwargs`` sampling (``val/*`` and the @N
    metrics), or greedily (``val/greedy/*``); returns the metrics and the images
    (``val/frames`` for frame predictions, uint8 [H, W, 3]). ``record(batch, repeats)`` sees
    the first scored chunk (the run's samples log).
    """
    n = 1 if greedy else cfg.actor_rollout_ref.rollout.val_kwargs.n
    metrics_sum, counts, images = {}, {}, {}
    scores, prompt_ids, answers, sources = [], [], [], []
    verifier_scores: dict[str, list[np.ndarray]] = {}
    offset = 0
    for i, chunk in enumerate(val_prompts.split(cfg.data.val_batch_size)):
        params = sampling_params(
            cfg, processor, cfg.trainer.seed + 7919 * i, validate=True, greedy=greedy
        )
        rows = with_row_seeds(chunk.repeat(n), params.seed)
        out = processor.decode(worker.generate_sequences(rows, params))
        result = runner.run(out)
        out, m = apply_scores(out, result, cfg)
        if record is not None and i == 0:
            record(out, n)
        scores.append(out["token_level_scores"].sum(-1))
        for k, v in m.items():  # a chunk may lack a mean (no sample scored): weigh by presence
            metrics_sum[k] = metrics_sum.get(k, 0.0) + v * len(out)
            counts[k] = counts.get(k, 0) + len(out)
        for name, values in result.verifier_scores.items():
            verifier_scores.setdefault(name, []).append(values)
        prompt_ids.append(offset + np.arange(len(chunk)).repeat(n))
        offset += len(chunk)
        if "response_text" in out.non_tensor:
            answers += [extract_answer(str(t)) for t in out.non_tensor["response_text"]]
        task = str(cfg.task.get("name", "val"))
        sources += list(out.non_tensor.get("data_source", [task] * len(out)))
        if i == 0 and not greedy and "pred_frames" in out and "gt_frames" in out:
            images["val/frames"] = frame_strip(out, n)
    all_scores = torch.cat(scores)
    prefix = "val/greedy" if greedy else "val"
    metrics = {
        f"{prefix}/{k.removeprefix('reward/')}": v / counts[k] for k, v in metrics_sum.items()
    }
    metrics[f"{prefix}/score/mean"] = float(all_scores.mean())
    if not greedy:
        variables = {"reward": all_scores.double().numpy()}
        variables.update({k: np.concatenate(v) for k, v in verifier_scores.items()})
        metrics.update(
            validation_metrics(
                sources,
                np.concatenate(prompt_ids),
                variables,
                answers if len(answers) == len(all_scores) else None,
                seed=cfg.trainer.seed,
            )
        )
    return metrics, images


def validate_all(
    cfg: RunConfig,
    val_prompts: Batch,
    worker: WorkerGroup,
    processor: PromptProcessor,
    runner: VerifierRunner,
    record: Callable[[Batch, int], None] | None = None,
) -> tuple[dict[str, float], dict[str, np.ndarray]]:
    """:func:`validate`, plus its greedy version when ``trainer.val_greedy`` is set."""
    metrics, images = validate(cfg, val_prompts, worker, processor, runner, record=record)
    if cfg.trainer.val_greedy:
        metrics.update(validate(cfg, val_prompts, worker, processor, runner, greedy=True)[0])
    return metrics, images


def frame_strip(batch: Batch, n: int, rows: int = STRIP_ROWS) -> np.ndarray:
    """uint8 [H', W', 3]: for the first ``rows`` prompts (their first sample; ``n`` samples per
    prompt), the last context frame, the true future and the predicted future side by side,
    separated by white gaps. An undecodable prediction shows grey."""
    picked = torch.arange(0, len(batch), n)[:rows]
    truth = _as_uint8(batch["gt_frames"][picked])  # [R, F, H, W, 3]
    pred = _as_uint8(batch["pred_frames"][picked])
    r, f, h, w, _ = truth.shape
    if "last_context_frame" in batch:
        context = _as_uint8(batch["last_context_frame"][picked])[:, None]
    else:
        context = np.zeros((r, 0, h, w, 3), np.uint8)
    gap = np.full((r, h, 2, 3), 255, np.uint8)
    pieces = []
    for frames in (context, truth, pred):
        if frames.shape[1]:
            pieces += [np.concatenate(list(frames.transpose(1, 0, 2, 3, 4)), axis=2), gap]
    line = np.concatenate(pieces[:-1], axis=2)  # [R, H, W', 3]
    spaced = np.concatenate([line, np.full((r, 2, line.shape[2], 3), 255, np.uint8)], axis=1)
    image = spaced.reshape(-1, *spaced.shape[2:])[:-2]
    return image.repeat(STRIP_SCALE, 0).repeat(STRIP_SCALE, 1)


def _as_uint8(frames: torch.Tensor) -> np.ndarray:
    """uint8 frames from uint8 [0, 255] or float [0, 1] (NaN: grey)."""
    if frames.dtype == torch.uint8:
        return frames.numpy()
    values = torch.nan_to_num(frames.float(), nan=0.5).clamp(0, 1)
    return (values * 255).round().to(torch.uint8).numpy()
