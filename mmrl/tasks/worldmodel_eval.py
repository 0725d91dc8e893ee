"""Held-out evaluation of a token world model.

Metrics per predicted frame, averaged over frames and windows: PSNR (dB), SSIM,
LPIPS (AlexNet), MAE (pixel units in [0, 1]), and, where the environment is known,
state match: whether the state read from the predicted frame by the renderer's exact
inverse (``state_from_frame``) equals the true one. The same functions as the reward
verifiers compute them, so evaluation and reward agree.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedModel

from mmrl.errors import CheckpointError, DataError
from mmrl.models.kv_cache import decoding_cache
from mmrl.verifiers.repetition import DEFAULT_TAU, repetition_rate
from mmrl.worldmodel.envs import frame_state_match, make_env
from mmrl.worldmodel.lm_init import TOKENIZER_SUBDIR  # a checkpoint carries its VQ tokenizer here
from mmrl.worldmodel.token_lm import TokenWorldModelProcessor
from mmrl.worldmodel.tokenizer import VQTokenizer
from mmrl.worldmodel.windows import longest_trajectory

METRICS = ("psnr", "ssim", "lpips", "mae", "state_match", "valid")


@lru_cache(maxsize=8)
def _env(spec_json: str):
    spec = json.loads(spec_json)
    return make_env(spec["name"], **spec.get("config", {}))


def env_from_spec(spec: dict[str, Any]):
    """A (cached) environment from ``{"name", "config"}``; used only for its pure functions."""
    return _env(json.dumps(spec, sort_keys=True))


@torch.no_grad()
def generate(
    model: PreTrainedModel,
    prompts: torch.Tensor,
    processor: TokenWorldModelProcessor,
    greedy: bool,
    temperature: float = 1.0,
    seed: int = 0,
    batch_size: int = 64,
    forced: torch.Tensor | None = None,
) -> torch.Tensor:
    """Responses ``int64 [N, response_length]`` constrained to visual tokens, greedy or sampled;
    ``forced [N, response_length]`` is written where it is not ``FREE`` (interleaved actions).

    ``prompts [N, P]`` all have one length (world-model prompts do), so no padding.
    Sampling draws from ``softmax(logits / temperature)`` over the visual ids, like the
    rollout engines with ``allowed_token_ids``.
    """
    allowed = torch.zeros(model.config.vocab_size, dtype=torch.bool)
    allowed[processor.allowed_token_ids()] = True
    gen = torch.Generator().manual_seed(seed)
    was_training = model.training
    model.eval()
    out = []
    for s in range(0, len(prompts), batch_size):
        ids, chunk = prompts[s : s + batch_size], []
        with decoding_cache(model, prompts.shape[1] + processor.response_length) as past:
            for step in range(processor.response_length):
                result = model(input_ids=ids, past_key_values=past, use_cache=True)
                logits = result.logits[:, -1].float().masked_fill(~allowed, float("-inf"))
                if greedy:
                    ids = logits.argmax(-1, keepdim=True)
                else:
                    ids = torch.multinomial(
                        torch.softmax(logits / temperature, -1), 1, generator=gen
                    )
                if forced is not None:
                    want = forced[s : s + batch_size, step : step + 1]
                    ids = torch.where(want >= 0, want, ids)
                chunk.append(ids)
        out.append(torch.cat(chunk, dim=1))
    model.train(was_training)
    return torch.cat(out)


def frame_scores(
    pred: np.ndarray,
    truth: np.ndarray,
    valid: np.ndarray,
    env: dict | None,
    last_context: np.ndarray | None = None,
    tau: float = DEFAULT_TAU,
    last_decoded: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """Per-window scores ``[N]`` (mean over its F frames) of ``pred``/``truth`` uint8 [N, F, H, W,
    3], and per future step: ``psnr@t1`` .. ``psnr@tF`` (likewise each metric).

    Invalid windows (``valid`` False) get NaN; ``state_match`` is NaN without an env.
    With ``last_context uint8 [N, H, W, 3]``, ``repetition`` is each window's repetition
    rate (:func:`mmrl.verifiers.repetition.repetition_rate`, threshold ``tau``;
    ``last_decoded``: that frame through the model's tokenizer).
    """
    from mmrl.verifiers.image import mae_per_frame, psnr_per_frame, ssim_per_frame
    from mmrl.verifiers.lpips import lpips_per_frame

    n, f = pred.shape[:2]
    p = torch.from_numpy(pred.reshape(n * f, *pred.shape[2:])).permute(0, 3, 1, 2).float() / 255
    t = torch.from_numpy(truth.reshape(n * f, *truth.shape[2:])).permute(0, 3, 1, 2).float() / 255
    scores = {}
    with torch.inference_mode():
        for name, fn in (
            ("psnr", psnr_per_frame),
            ("ssim", ssim_per_frame),
            ("lpips", lpips_per_frame),
            ("mae", mae_per_frame),
        ):
            vals = torch.cat([fn(p[i : i + 256], t[i : i + 256]) for i in range(0, n * f, 256)])
            scores[name] = vals.reshape(n, f).double().numpy()
    if env is not None:
        e = env_from_spec(env)
        match = [
            frame_state_match(e, a, b)[0]
            for a, b in zip(
                pred.reshape(-1, *pred.shape[2:]), truth.reshape(-1, *truth.shape[2:]), strict=True
            )
        ]
        scores["state_match"] = np.asarray(match, dtype=float).reshape(n, f)
    else:
        scores["state_match"] = np.full((n, f), np.nan)
    out = {}
    for k, per_step in scores.items():
        per_step = np.where(valid[:, None], per_step, np.nan)
        out[k] = per_step.mean(1)
        out.update({f"{k}@t{t + 1}": per_step[:, t] for t in range(f)})
    if last_context is not None:

        def unit(x: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(x).float() / 255

        decoded = None if last_decoded is None else unit(last_decoded)
        rate = repetition_rate(unit(pred), unit(truth), unit(last_context), tau, decoded)
        out["repetition"] = np.where(valid, rate, np.nan)
    out["valid"] = valid.astype(float)
    return out


def step_slopes(metrics: dict[str, float], future: int) -> dict[str, float]:
    """Least-squares slope per future step of each metric's ``@t1 .. @tF`` means (drift)."""
    if future < 2:
        return {}
    t = np.arange(1, future + 1, dtype=float)
    out = {}
    for name in METRICS[:-1]:
        y = np.array([metrics.get(f"{name}@t{i}", np.nan) for i in t.astype(int)])
        out[f"{name}/slope"] = float(np.polyfit(t, y, 1)[0]) if np.isfinite(y).all() else np.nan
    return out


@dataclass
class EvalResult:
    """Mean metrics over windows (and samples), each metric per window (mean over samples; for
    paired comparisons of two models on the same windows), and the predictions
    ``uint8 [N, F, H, W, 3]`` of the first sample per window (for frame strips)."""

    metrics: dict[str, float]
    predictions: np.ndarray
    per_window: dict[str, np.ndarray]


def evaluate_model(
    model: PreTrainedModel,
    processor: TokenWorldModelProcessor,
    tokenizer: VQTokenizer,
    windows: Any,
    greedy: bool,
    samples: int = 1,
    seed: int = 0,
    temperature: float = 1.0,
    tau: float = DEFAULT_TAU,
) -> EvalResult:
    """Predict every window's future (``samples`` times when sampling) and score it;
    ``tau`` is the repetition threshold."""
    from mmrl.processors.worldmodel import WorldModelPromptProcessor

    wm_prompts = WorldModelPromptProcessor(processor, tokenizer)
    prompts, forced = wm_prompts.encode_windows(windows), wm_prompts.forced_ids(windows)
    decoded = through_tokenizer(tokenizer, windows.context[:, -1])
    runs = 1 if greedy else samples
    per_run, first = [], None
    for r in range(runs):
        responses = generate(
            model, prompts, processor, greedy, temperature, seed + 7919 * r, forced=forced
        )
        frames, valid, _ = processor.decode_frames(responses.tolist(), tokenizer)
        first = frames if first is None else first
        per_run.append(
            frame_scores(
                frames, windows.future, valid, windows.env, windows.context[:, -1], tau, decoded
            )
        )
    result = summarize_runs(per_run, first)
    result.metrics.update(step_slopes(result.metrics, processor.future))
    return result


def summarize_runs(per_run: list[dict[str, np.ndarray]], first: np.ndarray) -> EvalResult:
    """Per-window scores of several decoding runs as means over everything and per window."""
    metrics = {k: _nanmean(np.concatenate([s[k] for s in per_run])) for k in per_run[0]}
    with warnings.catch_warnings():  # a window invalid in every run stays NaN
        warnings.simplefilter("ignore", RuntimeWarning)
        per_window = {k: np.nanmean(np.stack([s[k] for s in per_run]), 0) for k in per_run[0]}
    return EvalResult(metrics, first, per_window)


def _nanmean(values: np.ndarray) -> float:
    finite = values[~np.isnan(values)]
    return float(finite.mean()) if len(finite) else float("nan")


def load_checkpoint(model_dir: str | Path, tokenizer_dir: str | Path | None = None):
    """``(model, processor, tokenizer)`` of a world-model checkpoint; the tokenizer comes from
    ``tokenizer_dir`` or the checkpoint's own ``vq_tokenizer/``."""
    from mmrl.worldmodel.token_lm import load_token_world_model

    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise CheckpointError(f"world-model checkpoint {model_dir} does not exist")
    tok_dir = Path(tokenizer_dir) if tokenizer_dir else model_dir / TOKENIZER_SUBDIR
    if not (tok_dir / "config.json").exists():
        raise CheckpointError(
            f"no VQ tokenizer at {tok_dir}: pass --tokenizer DIR (a folder written by "
            "train_vq_tokenizer)"
        )
    model, processor = load_token_world_model(model_dir)
    tokenizer = VQTokenizer.from_pretrained(tok_dir)
    processor.check_tokenizer(tokenizer)
    return model.float().eval(), processor, tokenizer


def compare_base_and_rl(
    base_dir: Path, rl_dir: Path, windows: Any, settings: Any, seed: int, progress: bool = False
) -> dict[str, Any]:
    """Both checkpoints on the same held-out windows, with the same greedy and sampled decoding.

    ``settings`` has ``samples`` and ``temperature``. Returns ``table``
    (``{model: {decoding: metrics}}``) and ``predictions`` (``{model: uint8 [N, F, H, W, 3]}``,
    greedy).
    """
    from tqdm.auto import tqdm

    table: dict[str, dict[str, dict[str, float]]] = {}
    per_window: dict[str, dict[str, dict[str, np.ndarray]]] = {}
    predictions = {}
    jobs = [(m, d) for m in ("base", "rl") for d in ("greedy", "sampled")]
    models = {}
    for name, decoding in tqdm(jobs, desc="held-out eval", disable=not progress):
        if name not in models:
            models[name] = load_checkpoint(base_dir if name == "base" else rl_dir)
        model, processor, tokenizer = models[name]
        res = evaluate_model(
            model,
            processor,
            tokenizer,
            windows,
            decoding == "greedy",
            settings.samples,
            seed,
            settings.temperature,
            getattr(settings, "repetition_tau", DEFAULT_TAU),
        )
        table.setdefault(name, {})[decoding] = res.metrics
        per_window.setdefault(name, {})[decoding] = res.per_window
        if decoding == "greedy":
            predictions[name] = res.predictions
    return {"table": table, "per_window": per_window, "predictions": predictions}


def format_table(rows: dict[str, dict[str, float]], title: str = "") -> str:
    """A Markdown table: one row per name, columns PSNR, SSIM, LPIPS, MAE, state match, valid."""
    head = (
        "| "
        + (title or "model")
        + " | PSNR dB ↑ | SSIM ↑ | LPIPS ↓ | MAE ↓ | state match ↑ | repeated ↓ | valid |"
    )
    lines = [head, "|---|---|---|---|---|---|---|---|"]
    for name, m in rows.items():
        lines.append(
            f"| {name} | {m['psnr']:.2f} | {m['ssim']:.4f} | {m['lpips']:.4f} | {m['mae']:.4f} | "
            f"{m['state_match']:.3f} | {m.get('repetition', float('nan')):.3f} | "
            f"{m['valid']:.2f} |"
        )
    return "\n".join(lines)


def reference_rows(
    windows: Any, tokenizer: VQTokenizer, future: int
) -> dict[str, dict[str, float]]:
    """Two references in token space: copying the last context frame (the trivial world
    model) and the true future's own tokens (the tokenizer's ceiling), both decoded."""
    shape = tokenizer.frame_shape
    last = np.repeat(windows.context[:, -1:], future, axis=1)
    ok = np.ones(len(windows), bool)
    rows = {}
    for name, frames in (
        ("copy last context frame", last),
        ("tokenizer ceiling (true tokens)", windows.future),
    ):
        flat = tokenizer.decode(tokenizer.encode(frames.reshape(-1, *shape, 3))).reshape(
            frames.shape
        )
        last = windows.context[:, -1]
        decoded = through_tokenizer(tokenizer, last)
        scores = frame_scores(flat, windows.future, ok, windows.env, last, last_decoded=decoded)
        rows[name] = {k: _nanmean(v) for k, v in scores.items()}
        rows[name].update(step_slopes(rows[name], future))
    return rows


def through_tokenizer(tokenizer: VQTokenizer, frames: np.ndarray) -> np.ndarray:
    """``frames uint8 [N, H, W, 3]`` encoded and decoded: how the model sees them."""
    return tokenizer.decode(tokenizer.encode(frames))


def format_steps(rows: dict[str, dict[str, float]], future: int, metrics=("psnr", "lpips")) -> str:
    """A Markdown table of each metric per future step t = 1..F, and its slope per step."""
    cols = [f"{m} t={t}" for m in metrics for t in range(1, future + 1)]
    cols += [f"{m} slope" for m in metrics] if future > 1 else []
    lines = ["| model | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for name, m in rows.items():
        vals = [m.get(f"{k}@t{t}", np.nan) for k in metrics for t in range(1, future + 1)]
        vals += [m.get(f"{k}/slope", np.nan) for k in metrics] if future > 1 else []
        lines.append(f"| {name} | " + " | ".join(f"{v:.4g}" for v in vals) + " |")
    return "\n".join(lines)


def open_trajectories(path: str | Path, num_actions: int | None = None):
    """A ``TrajectoryDataset`` (folder with ``index.json``) or a ``VideoDataset`` (a folder of
    videos with sidecar actions, or one video file); a clear error for anything else."""
    from mmrl.worldmodel.data import INDEX_FILE, TrajectoryDataset
    from mmrl.worldmodel.video import VIDEO_SUFFIXES, VideoDataset, holds_videos

    path = Path(path)
    if not path.exists():
        raise DataError(f"data {path} does not exist")
    if (path / INDEX_FILE).exists():
        return TrajectoryDataset(path)
    if holds_videos(path) or path.suffix.lower() in VIDEO_SUFFIXES:
        return VideoDataset(path if path.is_dir() else [path], num_actions=num_actions)
    raise ValueError(
        f"{path} is neither a trajectory dataset (no {INDEX_FILE}) nor a folder of videos with "
        "sidecar actions (.npy/.csv); see docs/worldmodel.md"
    )


def check_source_fits(
    source: Any, processor: TokenWorldModelProcessor, tokenizer: VQTokenizer, where: str
) -> None:
    """Raise unless the data's frame size and actions are what the checkpoint was trained on."""
    info, want = source.info, processor.layout.action
    h, w = tokenizer.frame_shape
    if (info.height, info.width) != (h, w):
        raise ValueError(
            f"{where}: frames are {info.height}x{info.width}, the model's tokenizer takes "
            f"{h}x{w}; resize the data or pretrain a model at this resolution"
        )
    if (info.action.kind, info.action.dim) != (
        want.kind,
        want.dim,
    ) or info.action.num_actions != want.num_actions:
        raise ValueError(
            f"{where}: actions are {info.action.kind} (dim {info.action.dim}, num_actions "
            f"{info.action.num_actions}); the model takes {want.kind} (dim {want.dim}, num_actions "
            f"{want.num_actions}). For discrete ids in an mp4 sidecar pass --num-actions"
        )
    got = info.action
    if want.kind == "continuous" and (got.low < want.low - 1e-6 or got.high > want.high + 1e-6):
        raise ValueError(
            f"{where}: actions span [{got.low:g}, {got.high:g}], outside the range "
            f"[{want.low:g}, {want.high:g}] the model was trained on (they would be clipped); "
            "rescale them or pretrain on data that covers this range"
        )


def check_trajectory_length(source: Any, context: int, future: int, where: str) -> None:
    """Raise unless some trajectory has the ``context + future`` frames one window needs."""
    longest = longest_trajectory(source)
    if longest < context + future:
        raise DataError(
            f"{where}: the longest trajectory has {longest} frames; the model needs "
            f"{context + future} "
            f"({context} context + {future} predicted)"
        )
