"""Paired base-vs-RL comparisons for learning tests: the same prompts, the same decoding,
the margin measured against the standard error of the per-prompt differences."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def paired_gain(base: np.ndarray, rl: np.ndarray, label: str) -> tuple[float, float]:
    """Mean and standard error of ``rl - base`` over the same prompts; printed, so a run's log
    shows how far the gain is from noise."""
    d = np.asarray(rl, dtype=float) - np.asarray(base, dtype=float)
    mean, se = float(d.mean()), float(d.std(ddof=1) / np.sqrt(len(d)))
    print(
        f"{label}: base {np.mean(base):.4g} -> RL {np.mean(rl):.4g} on {len(d)} paired prompts, "
        f"gain {mean:+.3g}, standard error {se:.3g} ({mean / max(se, 1e-12):.1f} SE)"
    )
    return mean, se


def greedy_text_scores(model_dir: Path, cfg, dataset) -> np.ndarray:
    """Per-prompt verifier scores of greedy answers of the checkpoint in ``model_dir`` on
    ``dataset``, through the task's processor, the transformers engine and the run's
    verifiers (the path validation takes)."""
    import torch

    from mmrl.models import policy_family
    from mmrl.sampling import SamplingParams
    from mmrl.tasks import get_task
    from mmrl.verifiers import VerifierRunner

    family = policy_family(model_dir)
    model = family.load(Path(model_dir)).eval()
    tokenizer = family.load_tokenizer(Path(model_dir))
    processor = get_task(cfg.task["name"])(cfg.task).build_prompt_processor(model_dir, cfg)
    prompts = processor.encode_dataset(dataset, "test")
    params = SamplingParams(max_tokens=cfg.data.max_response_length, do_sample=False)
    with torch.no_grad():
        out = family.generate(model, prompts, params, tokenizer)
    out = processor.decode(out)
    runner = VerifierRunner.from_config(cfg.reward)
    try:
        return np.asarray(runner.run(out).scores, dtype=float)
    finally:
        runner.close()
