"""Held-out evaluation of latent world-model policies: Gaussian heads (``latent_policy.json``)
and flow-matching velocities (``flow_policy.json``).

Frames come from the same processor and rollout engine as RL, and are scored by
:func:`~mmrl.tasks.worldmodel_eval.frame_scores`, as token world models are.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from mmrl.tasks.worldmodel_eval import EvalResult, _nanmean, frame_scores, summarize_runs
from mmrl.verifiers.repetition import DEFAULT_TAU

LATENT_FAMILIES = ("latent", "flow_latent")  # policies over autoencoder latents


def load_latent_policy(model_dir: str | Path) -> tuple[Any, Any, str]:
    """``(policy, autoencoder, family name)`` of a latent policy folder: a Gaussian head
    (``latent_policy.json``) or a flow-matching velocity (``flow_policy.json``), each with the
    ``autoencoder/`` that defines its latent space."""
    from mmrl.models import policy_family
    from mmrl.models.latent_policy import AUTOENCODER_DIR
    from mmrl.worldmodel.latent_ae import LatentAutoencoder

    ae_dir = Path(model_dir) / AUTOENCODER_DIR
    if not ae_dir.is_dir():
        raise FileNotFoundError(
            f"{model_dir} has no {AUTOENCODER_DIR}/ folder: a latent policy folder carries the "
            "autoencoder that defines its latent space"
        )
    family = policy_family(model_dir)
    if family.name not in LATENT_FAMILIES:
        raise ValueError(f"{model_dir} holds a {family.name} policy, not a latent world model")
    policy = family.load(Path(model_dir)).float().eval()
    return policy, LatentAutoencoder.from_pretrained(ae_dir), family.name


def check_source_fits_latent(source: Any, policy: Any, ae: Any, where: str) -> None:
    """Raise unless the data's frame size and action dimension are the latent policy's."""
    info, (h, w), dim = source.info, ae.frame_shape, policy.cfg.action_dim
    if (info.height, info.width) != (h, w):
        raise ValueError(
            f"{where}: frames are {info.height}x{info.width}, the policy's autoencoder takes "
            f"{h}x{w}"
        )
    if info.action.dim != dim:
        raise ValueError(
            f"{where}: actions have dimension {info.action.dim}; the latent policy takes {dim}"
        )


def predict_latent(
    policy: Any,
    ae: Any,
    windows: Any,
    greedy: bool,
    temperature: float = 1.0,
    seed: int = 0,
    family: str = "latent",
) -> np.ndarray:
    """Frames ``uint8 [N, F, H, W, 3]`` predicted for ``windows`` by a latent policy of the
    policy family ``family``: greedy (its means, a flow policy's ODE) or sampled at
    ``temperature``, through the same processor and rollout engine as RL."""
    from mmrl.models import get_family
    from mmrl.processors.latent import LatentWorldModelProcessor
    from mmrl.rollout.module import ModuleRollout
    from mmrl.sampling import SamplingParams

    processor = LatentWorldModelProcessor(ae, windows.context.shape[1], windows.future.shape[1])
    prompts = processor.encode_dataset(windows, "eval")
    sampling = SamplingParams(
        **processor.sampling_overrides(), do_sample=not greedy, temperature=temperature, seed=seed
    )
    engine = ModuleRollout(policy, get_family(family))
    return processor.decode(engine.generate(prompts, sampling))["pred_frames"].numpy()


def through_autoencoder(ae: Any, frames: np.ndarray) -> np.ndarray:
    """``frames uint8 [..., H, W, 3]`` encoded and decoded by ``ae``: what a perfect latent
    prediction of them would decode to."""
    flat = frames.reshape(-1, *frames.shape[-3:])
    return ae.decode(ae.encode(flat)).reshape(frames.shape)


def evaluate_latent(
    policy: Any,
    ae: Any,
    windows: Any,
    greedy: bool,
    samples: int = 1,
    seed: int = 0,
    temperature: float = 1.0,
    family: str = "latent",
    tau: float = DEFAULT_TAU,
) -> EvalResult:
    """Like :func:`evaluate_model` for a latent policy of the family ``family`` (greedy: the
    means, or a flow policy's ODE; no invalid frames). The repetition rate (threshold ``tau``)
    compares the first predicted frame with the last context frame through the autoencoder."""
    ok = np.ones(len(windows), bool)
    last = windows.context[:, -1]
    decoded = through_autoencoder(ae, last)
    per_run, first = [], None
    for r in range(1 if greedy else samples):
        frames = predict_latent(policy, ae, windows, greedy, temperature, seed + 7919 * r, family)
        first = frames if first is None else first
        per_run.append(frame_scores(frames, windows.future, ok, windows.env, last, tau, decoded))
    return summarize_runs(per_run, first)


def latent_reference_rows(
    windows: Any, ae: Any, future: int, tau: float = DEFAULT_TAU
) -> dict[str, dict[str, float]]:
    """Two references through the policy's autoencoder: copying the last context frame, and
    the true future itself (the autoencoder's ceiling), both encoded and decoded."""
    last = windows.context[:, -1]
    decoded = through_autoencoder(ae, last)
    ok = np.ones(len(windows), bool)
    rows = {}
    copy, ceiling = (
        np.repeat(decoded[:, None], future, axis=1),
        through_autoencoder(ae, windows.future),
    )
    for name, frames in (
        ("copy last context frame (through the AE)", copy),
        ("autoencoder ceiling (true future through the AE)", ceiling),
    ):
        scores = frame_scores(frames, windows.future, ok, windows.env, last, tau, decoded)
        rows[name] = {k: _nanmean(v) for k, v in scores.items()}
    return rows


def compare_latent_base_and_rl(
    base_dir: Path, rl_dir: Path, windows: Any, settings: Any, seed: int
) -> dict[str, dict[str, dict[str, float]]]:
    """Both latent policy folders (Gaussian or flow) on the same held-out windows, greedy and
    sampled (``settings`` has ``samples`` and ``temperature``), plus the base autoencoder's
    references: ``{"base" | "rl": {decoding: metrics}, "reference": {name: metrics}}``."""
    tau = getattr(settings, "repetition_tau", DEFAULT_TAU)
    table: dict[str, dict[str, dict[str, float]]] = {}
    for name, path in (("base", base_dir), ("rl", rl_dir)):
        policy, ae, family = load_latent_policy(path)
        greedy = evaluate_latent(policy, ae, windows, True, seed=seed, family=family, tau=tau)
        sampled = evaluate_latent(
            policy, ae, windows, False, settings.samples, seed, settings.temperature, family, tau
        )
        table[name] = {"greedy": greedy.metrics, "sampled": sampled.metrics}
        if name == "base":
            future = windows.future.shape[1]
            table["reference"] = latent_reference_rows(windows, ae, future, tau)
    return {k: table[k] for k in ("base", "rl", "reference")}
