"""A checkpoint's per-prompt verifier scores on a task's dataset split, decoded like the run.

Final claims (learning tests, benchmark tables) compare two checkpoints, usually the
starting model and the RL actor, on the same test prompts with the same decoding and the
same sampling seeds, so their difference is paired prompt by prompt.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from mmrl.config import RunConfig
from mmrl.models import policy_family
from mmrl.sampling import SamplingParams
from mmrl.tasks import get_task
from mmrl.verifiers import VerifierRunner

CHUNK = 32  # prompts per generate call; sampling seeds follow the chunk index


def checkpoint_scores(
    model_dir: str | Path,
    cfg: RunConfig,
    dataset: Any,
    samples: int = 1,
    do_sample: bool = False,
    temperature: float = 1.0,
) -> np.ndarray:
    """Verifier scores ``[N, samples]`` of the checkpoint in ``model_dir`` (any policy family)
    on ``dataset``, through the task's prompt processor and ``cfg.reward``'s verifiers.

    Seeds depend only on the chunk of prompts, so two checkpoints get the same seeds.
    """
    model_dir = Path(model_dir)
    family = policy_family(model_dir)
    model = family.load(model_dir).eval()
    tokenizer = family.load_tokenizer(model_dir)
    processor = get_task(cfg.task["name"])(cfg.task).build_prompt_processor(model_dir, cfg)
    prompts = processor.encode_dataset(dataset, "test")
    scores = []
    with VerifierRunner.from_config(cfg.reward) as runner:
        for i, chunk in enumerate(prompts.split(CHUNK)):
            settings = {
                "max_tokens": cfg.data.max_response_length,
                "temperature": temperature,
                "do_sample": do_sample,
                "seed": 1000 + i,
                **processor.sampling_overrides(),  # e.g. a latent policy's step count
            }
            params = SamplingParams(**settings)
            with torch.no_grad():
                out = family.generate(model, chunk.repeat(samples), params, tokenizer)
            s = np.asarray(runner.run(processor.decode(out)).scores, dtype=float)
            scores.append(s.reshape(len(chunk), samples))
    return np.concatenate(scores)


def accuracy(scores: np.ndarray, cfg: RunConfig) -> float:
    """The share of answers the first (the answer) verifier accepted: a score of at least its
    weight, whatever smaller bonuses (a format reward) add."""
    return float(np.mean(scores >= cfg.reward.verifiers[0].weight - 1e-9))
