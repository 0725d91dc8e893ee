"""Held-out evaluation of a token world model or a latent policy, the closed-loop
``state_match`` score, and the ``mmrl eval`` command.

Metrics per predicted frame, averaged over frames and windows: PSNR (dB), SSIM,
LPIPS (AlexNet), MAE (pixel units in [0, 1]), and, where the environment is known,
state match: whether the state read from the predicted frame by the renderer's exact
inverse (``state_from_frame``) equals the true one. The same functions as the reward
verifiers compute them, so evaluation and reward agree.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedModel

from mmrl.verifiers.closed_loop import ClosedLoopSample, register_task_score
from mmrl.worldmodel.envs import make_env, states_equal
from mmrl.worldmodel.token_lm import TokenWorldModelProcessor
from mmrl.worldmodel.tokenizer import VQTokenizer

TOKENIZER_SUBDIR = "vq_tokenizer"  # a world-model checkpoint carries its VQ tokenizer here
METRICS = ("psnr", "ssim", "lpips", "mae", "state_match", "valid")


@lru_cache(maxsize=8)
def _env(spec_json: str):
    spec = json.loads(spec_json)
    return make_env(spec["name"], **spec.get("config", {}))


def env_from_spec(spec: dict[str, Any]):
    """A (cached) environment from ``{"name", "config"}``; used only for its pure functions."""
    return _env(json.dumps(spec, sort_keys=True))


@register_task_score("state_match")
def state_match(sample: ClosedLoopSample) -> float:
    """Fraction of predicted frames whose observed state equals the true one.

    ``sample.env`` is ``{"name", "config"}``; ``sample.ground_truth`` the true observed
    states, one per future frame (set by the world-model processor).
    """
    env = env_from_spec(sample.env)
    frames = (sample.predicted_frames.clamp(0, 1) * 255).round().to(torch.uint8).cpu().numpy()
    if np.isnan(sample.predicted_frames.cpu().numpy()).any():
        return float("nan")  # an undecodable response: invalid, not a score
    truths = sample.ground_truth
    return float(np.mean([states_equal(env.state_from_frame(f), t) for f, t in zip(frames, truths, strict=True)]))


@torch.no_grad()
def generate(
    model: PreTrainedModel, prompts: torch.Tensor, processor: TokenWorldModelProcessor,
    greedy: bool, temperature: float = 1.0, seed: int = 0, batch_size: int = 64,
) -> torch.Tensor:
    """Responses ``int64 [N, F*h*w]`` constrained to visual tokens, greedy or sampled.

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
        ids, past, chunk = prompts[s : s + batch_size], None, []
        for _ in range(processor.response_length):
            result = model(input_ids=ids, past_key_values=past, use_cache=True)
            past = result.past_key_values
            logits = result.logits[:, -1].float().masked_fill(~allowed, float("-inf"))
            if greedy:
                ids = logits.argmax(-1, keepdim=True)
            else:
                ids = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=gen)
            chunk.append(ids)
        out.append(torch.cat(chunk, dim=1))
    model.train(was_training)
    return torch.cat(out)


def frame_scores(pred: np.ndarray, truth: np.ndarray, valid: np.ndarray, env: dict | None) -> dict[str, np.ndarray]:
    """Per-window scores ``[N]`` (mean over its F frames) of ``pred``/``truth`` uint8 [N, F, H, W, 3].

    Invalid windows (``valid`` False) get NaN; ``state_match`` is NaN without an env.
    """
    from mmrl.verifiers.image import mae_per_frame, psnr_per_frame, ssim_per_frame
    from mmrl.verifiers.lpips import lpips_per_frame

    n, f = pred.shape[:2]
    p = torch.from_numpy(pred.reshape(n * f, *pred.shape[2:])).permute(0, 3, 1, 2).float() / 255
    t = torch.from_numpy(truth.reshape(n * f, *truth.shape[2:])).permute(0, 3, 1, 2).float() / 255
    scores = {}
    with torch.inference_mode():
        for name, fn in (("psnr", psnr_per_frame), ("ssim", ssim_per_frame), ("lpips", lpips_per_frame),
                         ("mae", mae_per_frame)):
            vals = torch.cat([fn(p[i : i + 256], t[i : i + 256]) for i in range(0, n * f, 256)])
            scores[name] = vals.reshape(n, f).mean(1).double().numpy()
    if env is not None:
        e = env_from_spec(env)
        match = [states_equal(e.state_from_frame(a), e.state_from_frame(b))
                 for a, b in zip(pred.reshape(-1, *pred.shape[2:]), truth.reshape(-1, *truth.shape[2:]), strict=True)]
        scores["state_match"] = np.asarray(match, dtype=float).reshape(n, f).mean(1)
    else:
        scores["state_match"] = np.full(n, np.nan)
    for k in scores:
        scores[k] = np.where(valid, scores[k], np.nan)
    scores["valid"] = valid.astype(float)
    return scores


@dataclass
class EvalResult:
    """Mean metrics over windows (and samples), and the predictions ``uint8 [N, F, H, W, 3]``
    of the first sample per window (for frame strips)."""

    metrics: dict[str, float]
    predictions: np.ndarray


def evaluate_model(
    model: PreTrainedModel, processor: TokenWorldModelProcessor, tokenizer: VQTokenizer, windows: Any,
    greedy: bool, samples: int = 1, seed: int = 0, temperature: float = 1.0,
) -> EvalResult:
    """Predict every window's future (``samples`` times when sampling) and score it."""
    from mmrl.processors.worldmodel import WorldModelPromptProcessor

    prompts = WorldModelPromptProcessor(processor, tokenizer).encode_windows(windows)
    runs = 1 if greedy else samples
    per_run, first = [], None
    for r in range(runs):
        responses = generate(model, prompts, processor, greedy, temperature, seed + 7919 * r)
        frames, valid, _ = processor.decode_frames(responses.tolist(), tokenizer)
        first = frames if first is None else first
        per_run.append(frame_scores(frames, windows.future, valid, windows.env))
    metrics = {k: _nanmean(np.concatenate([s[k] for s in per_run])) for k in METRICS}
    return EvalResult(metrics, first)


def _nanmean(values: np.ndarray) -> float:
    finite = values[~np.isnan(values)]
    return float(finite.mean()) if len(finite) else float("nan")


def load_checkpoint(model_dir: str | Path, tokenizer_dir: str | Path | None = None):
    """``(model, processor, tokenizer)`` of a world-model checkpoint; the tokenizer comes from
    ``tokenizer_dir`` or the checkpoint's own ``vq_tokenizer/``."""
    from mmrl.worldmodel.token_lm import load_token_world_model

    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"world-model checkpoint {model_dir} does not exist")
    tok_dir = Path(tokenizer_dir) if tokenizer_dir else model_dir / TOKENIZER_SUBDIR
    if not (tok_dir / "config.json").exists():
        raise FileNotFoundError(
            f"no VQ tokenizer at {tok_dir}: pass --tokenizer DIR (a folder written by train_vq_tokenizer)"
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
    predictions = {}
    jobs = [(m, d) for m in ("base", "rl") for d in ("greedy", "sampled")]
    models = {}
    for name, decoding in tqdm(jobs, desc="held-out eval", disable=not progress):
        if name not in models:
            models[name] = load_checkpoint(base_dir if name == "base" else rl_dir)
        model, processor, tokenizer = models[name]
        res = evaluate_model(model, processor, tokenizer, windows, decoding == "greedy", settings.samples,
                             seed, settings.temperature)
        table.setdefault(name, {})[decoding] = res.metrics
        if decoding == "greedy":
            predictions[name] = res.predictions
    return {"table": table, "predictions": predictions}


def format_table(rows: dict[str, dict[str, float]], title: str = "") -> str:
    """A Markdown table: one row per name, columns PSNR, SSIM, LPIPS, MAE, state match, valid."""
    head = "| " + (title or "model") + " | PSNR dB ↑ | SSIM ↑ | LPIPS ↓ | MAE ↓ | state match ↑ | valid |"
    lines = [head, "|---|---|---|---|---|---|---|"]
    for name, m in rows.items():
        lines.append(f"| {name} | {m['psnr']:.2f} | {m['ssim']:.4f} | {m['lpips']:.4f} | {m['mae']:.4f} | "
                     f"{m['state_match']:.3f} | {m['valid']:.2f} |")
    return "\n".join(lines)


def reference_rows(windows: Any, tokenizer: VQTokenizer, future: int) -> dict[str, dict[str, float]]:
    """Two references in token space: copying the last context frame (the trivial world
    model) and the true future's own tokens (the tokenizer's ceiling), both decoded."""
    size = tokenizer.frame_size
    last = np.repeat(windows.context[:, -1:], future, axis=1)
    ok = np.ones(len(windows), bool)
    rows = {}
    for name, frames in (("copy last context frame", last), ("tokenizer ceiling (true tokens)", windows.future)):
        flat = tokenizer.decode(tokenizer.encode(frames.reshape(-1, size, size, 3))).reshape(frames.shape)
        rows[name] = {k: _nanmean(v) for k, v in frame_scores(flat, windows.future, ok, windows.env).items()}
    return rows


def open_trajectories(path: str | Path, num_actions: int | None = None):
    """A ``TrajectoryDataset`` (folder with ``index.json``) or a ``VideoDataset`` (folder of
    ``*.mp4`` with sidecar actions); a clear error for anything else."""
    from mmrl.worldmodel.data import INDEX_FILE, TrajectoryDataset
    from mmrl.worldmodel.video import VideoDataset

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"data {path} does not exist")
    if (path / INDEX_FILE).exists():
        return TrajectoryDataset(path)
    if path.is_dir() and any(path.glob("*.mp4")) or path.suffix == ".mp4":
        return VideoDataset(path if path.is_dir() else [path], num_actions=num_actions)
    raise ValueError(
        f"{path} is neither a trajectory dataset (no {INDEX_FILE}) nor a folder of .mp4 files with "
        "sidecar actions (.npy/.csv); see docs/worldmodel.md"
    )


def check_source_fits(source: Any, processor: TokenWorldModelProcessor, tokenizer: VQTokenizer, where: str) -> None:
    """Raise unless the data's frame size and actions are what the checkpoint was trained on."""
    info, want = source.info, processor.layout.action
    size = tokenizer.frame_size
    if (info.height, info.width) != (size, size):
        raise ValueError(f"{where}: frames are {info.height}x{info.width}, the model's tokenizer takes {size}x{size}")
    if (info.action.kind, info.action.dim) != (want.kind, want.dim) or info.action.num_actions != want.num_actions:
        raise ValueError(
            f"{where}: actions are {info.action.kind} (dim {info.action.dim}, num_actions "
            f"{info.action.num_actions}); the model takes {want.kind} (dim {want.dim}, num_actions "
            f"{want.num_actions}). For discrete ids in an mp4 sidecar pass --num-actions"
        )


def check_trajectory_length(source: Any, context: int, future: int, where: str) -> None:
    """Raise unless some trajectory has the ``context + future`` frames one window needs."""
    longest = max((source.num_frames(i) for i in range(len(source))), default=0)
    if longest < context + future:
        raise ValueError(
            f"{where}: the longest trajectory has {longest} frames; the model needs {context + future} "
            f"({context} context + {future} predicted)"
        )


def load_latent_policy(model_dir: str | Path):
    """``(policy, autoencoder)`` of a latent policy folder (``latent_policy.json`` + ``autoencoder/``)."""
    from mmrl.models.latent_policy import AUTOENCODER_DIR, GaussianLatentPolicy
    from mmrl.worldmodel.latent_ae import LatentAutoencoder

    ae_dir = Path(model_dir) / AUTOENCODER_DIR
    if not ae_dir.is_dir():
        raise FileNotFoundError(
            f"{model_dir} has no {AUTOENCODER_DIR}/ folder: a latent policy folder carries the "
            "autoencoder that defines its latent space"
        )
    return GaussianLatentPolicy.from_pretrained(model_dir).float().eval(), LatentAutoencoder.from_pretrained(ae_dir)


def check_source_fits_latent(source: Any, policy: Any, ae: Any, where: str) -> None:
    """Raise unless the data's frame size and action dimension are the latent policy's."""
    info, size, dim = source.info, ae.frame_size, policy.cfg.action_dim
    if (info.height, info.width) != (size, size):
        raise ValueError(f"{where}: frames are {info.height}x{info.width}, the policy's autoencoder takes {size}x{size}")
    if info.action.dim != dim:
        raise ValueError(f"{where}: actions have dimension {info.action.dim}; the latent policy takes {dim}")


def predict_latent(policy: Any, ae: Any, windows: Any, greedy: bool, temperature: float = 1.0,
                   seed: int = 0) -> np.ndarray:
    """Frames ``uint8 [N, F, H, W, 3]`` predicted for ``windows`` by a latent policy: its means
    (``greedy``) or samples at ``temperature``, through the same processor and rollout engine as RL."""
    from mmrl.processors.latent import LatentWorldModelProcessor
    from mmrl.sampling import SamplingParams
    from mmrl.rollout.latent import LatentRollout

    processor = LatentWorldModelProcessor(ae, windows.context.shape[1], windows.future.shape[1])
    prompts = processor.encode_dataset(windows, "eval")
    sampling = SamplingParams(**processor.sampling_overrides(), do_sample=not greedy, temperature=temperature,
                              seed=seed)
    return processor.decode(LatentRollout(policy).generate(prompts, sampling))["pred_frames"].numpy()


def evaluate_latent(policy: Any, ae: Any, windows: Any, greedy: bool, samples: int = 1, seed: int = 0,
                    temperature: float = 1.0) -> EvalResult:
    """Like :func:`evaluate_model` for a latent policy (greedy: the means; no invalid frames)."""
    ok = np.ones(len(windows), bool)
    per_run, first = [], None
    for r in range(1 if greedy else samples):
        frames = predict_latent(policy, ae, windows, greedy, temperature, seed + 7919 * r)
        first = frames if first is None else first
        per_run.append(frame_scores(frames, windows.future, ok, windows.env))
    return EvalResult({k: _nanmean(np.concatenate([s[k] for s in per_run])) for k in METRICS}, first)


def latent_reference_rows(windows: Any, ae: Any, future: int) -> dict[str, dict[str, float]]:
    """Two references through the policy's autoencoder: copying the last context frame, and
    the true future itself (the autoencoder's ceiling), both encoded and decoded."""
    last = np.repeat(windows.context[:, -1:], future, axis=1)
    ok = np.ones(len(windows), bool)
    rows = {}
    for name, frames in (("copy last context frame (through the AE)", last),
                         ("autoencoder ceiling (true future through the AE)", windows.future)):
        flat = ae.decode(ae.encode(frames.reshape(-1, *frames.shape[2:]))).reshape(frames.shape)
        rows[name] = {k: _nanmean(v) for k, v in frame_scores(flat, windows.future, ok, windows.env).items()}
    return rows


def main(argv: list[str] | None = None) -> int:
    """``mmrl eval --model DIR --data DIR``: metrics of a world-model checkpoint (token world
    model or latent policy folder) on trajectory data."""
    import argparse

    from mmrl.models.latent_policy import is_latent_policy_dir
    from mmrl.processors.worldmodel import load_windows

    p = argparse.ArgumentParser(prog="mmrl eval", description=main.__doc__)
    p.add_argument("--model", required=True, help="world-model checkpoint (token_wm/best, an RL actor/ folder) "
                   "or a latent policy folder (latent_policy.json + autoencoder/)")
    p.add_argument("--data", required=True, help="trajectory dataset folder, or a folder of .mp4 + actions")
    p.add_argument("--tokenizer", help="VQ tokenizer folder (default: <model>/vq_tokenizer)")
    p.add_argument("--future", type=int,
                   help="frames a latent policy predicts per window (default 2; a token model has its own)")
    p.add_argument("--windows", type=int, default=64, help="windows drawn from the data (all if fewer)")
    p.add_argument("--samples", type=int, default=4, help="sampled predictions per window")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--num-actions", type=int, help="mp4 sidecars hold discrete action ids in [0, N)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the metrics here")
    args = p.parse_args(argv)
    sampled = f"model (sampled x{args.samples}, T={args.temperature:g})"
    if is_latent_policy_dir(args.model):
        policy, ae = load_latent_policy(args.model)
        context, future = policy.cfg.context, args.future or 2
        source = open_trajectories(args.data, args.num_actions)
        check_source_fits_latent(source, policy, ae, args.data)
        check_trajectory_length(source, context, future, args.data)
        windows = load_windows(source, context, future, args.windows, args.seed)
        rows = {
            "model (greedy)": evaluate_latent(policy, ae, windows, True, seed=args.seed).metrics,
            sampled: evaluate_latent(policy, ae, windows, False, args.samples, args.seed, args.temperature).metrics,
        }
        rows.update(latent_reference_rows(windows, ae, future))
        kind = "latent policy"
    else:
        model, processor, tokenizer = load_checkpoint(args.model, args.tokenizer)
        context, future = processor.context, processor.future
        if args.future is not None and args.future != future:
            raise ValueError(f"--future {args.future}: the token world model {args.model} predicts {future} frames")
        source = open_trajectories(args.data, args.num_actions)
        check_source_fits(source, processor, tokenizer, args.data)
        check_trajectory_length(source, context, future, args.data)
        windows = load_windows(source, context, future, args.windows, args.seed)
        rows = {
            "model (greedy)": evaluate_model(model, processor, tokenizer, windows, True, seed=args.seed).metrics,
            sampled: evaluate_model(
                model, processor, tokenizer, windows, False, args.samples, args.seed, args.temperature).metrics,
        }
        rows.update(reference_rows(windows, tokenizer, future))
        kind = "token world model"
    env = windows.env["name"] if windows.env else "unknown (no state match)"
    print(f"\n{kind}; {len(windows)} windows of {args.data} (env: {env}); {context} context frames, "
          f"{future} predicted\n")
    print(format_table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0
