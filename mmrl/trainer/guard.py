"""What a step does with samples no verifier could score, and when a run stops for them.

- A step whose samples are all invalid (``valid_mask`` all False) has no signal to learn
  from: the actor and critic updates, their optimizer steps and the lr schedule are
  skipped (``actor/skipped_update = 1``). Adam would otherwise still move every weight
  on its momentum alone.
- Groups whose valid samples all scored the same have zero GRPO advantages; the KL loss
  still pulls them towards the reference, as in verl. ``trainer.skip_zero_variance_updates``
  leaves them out of the update instead.
- :class:`InvalidRateMonitor`: ``reward/invalid_rate`` above ``trainer.max_invalid_rate``
  for ``trainer.invalid_rate_patience`` steps in a row stops the run, naming the verifier
  and its most common error.
"""

from __future__ import annotations

import numpy as np
import torch

from mmrl.errors import VerifierError
from mmrl.protocol import Batch

INVALID_RATE = "reward/invalid_rate"


class InvalidRateError(VerifierError):
    """Too many steps in a row had too many samples the verifiers could not score."""


def zero_variance_mask(scores: torch.Tensor, valid: torch.Tensor, uids: np.ndarray) -> torch.Tensor:
    """bool [B]: valid samples whose group (same uid) has one distinct valid score.

    ``scores`` [B] are sequence scores, ``valid`` bool [B], ``uids`` [B] group ids.
    """
    _, inverse = np.unique(np.asarray(uids, dtype=str), return_inverse=True)
    group = torch.from_numpy(inverse.reshape(-1)).long()
    groups = int(group.max()) + 1 if len(group) else 0
    s = scores.double()
    high = torch.full((groups,), -torch.inf, dtype=torch.float64)
    low = torch.full((groups,), torch.inf, dtype=torch.float64)
    high = high.scatter_reduce(0, group, torch.where(valid, s, -torch.inf), "amax")
    low = low.scatter_reduce(0, group, torch.where(valid, s, torch.inf), "amin")
    return valid & (high[group] == low[group])


def batch_for_update(batch: Batch, skip_zero_variance: bool) -> tuple[Batch | None, dict]:
    """The batch the actor and critic update on, or None when no sample is left to learn from.

    The returned batch is a copy: the update reorders it, and the step's metrics read the
    original. With ``skip_zero_variance`` its ``valid_mask`` also drops zero-variance groups.
    """
    valid = batch["valid_mask"].bool()
    flat = zero_variance_mask(batch["token_level_scores"].sum(-1), valid, batch["uid"])
    metrics = {"actor/zero_variance_frac": float(flat.sum()) / max(int(valid.sum()), 1)}
    keep = valid & ~flat if skip_zero_variance else valid
    metrics["actor/skipped_update"] = float(not keep.any())
    if not keep.any():
        return None, metrics
    update = batch.clone()
    update["valid_mask"] = keep
    return update, metrics


class InvalidRateMonitor:
    """Counts consecutive steps whose ``reward/invalid_rate`` exceeds ``max_rate``.

    ``max_rate`` None never stops the run.
    """

    def __init__(self, max_rate: float | None, patience: int) -> None:
        if max_rate is not None and not 0.0 <= max_rate <= 1.0:
            raise ValueError(
                f"trainer.max_invalid_rate must be in [0, 1] or null, found {max_rate}"
            )
        if patience < 1:
            raise ValueError(f"trainer.invalid_rate_patience must be >= 1, found {patience}")
        self.max_rate, self.patience, self.streak = max_rate, patience, 0

    def should_stop(self, metrics: dict[str, float]) -> bool:
        """Record one step's metrics; True once ``patience`` steps in a row were over the limit."""
        rate = metrics.get(INVALID_RATE, 0.0)
        over = self.max_rate is not None and rate > self.max_rate
        self.streak = self.streak + 1 if over else 0
        return self.streak >= self.patience

    def error(self, metrics: dict[str, float], examples: dict, checkpoint: str) -> InvalidRateError:
        """The error that stops the run: the verifier with the most failures, its most common
        kind of error with an example message, and where the checkpoint went.

        ``examples``: (verifier name, error kind) -> the latest message of that kind.
        """
        counts = {}
        for key, value in metrics.items():
            if key.startswith("reward/") and "/errors/" in key:
                name, kind = key.removeprefix("reward/").rsplit("/errors/", 1)
                counts[(name, kind)] = value
        cause = "no verifier reported an error: they marked the samples invalid themselves"
        if counts and max(counts.values()) > 0:
            (name, kind), count = max(counts.items(), key=lambda item: item[1])
            example = examples.get((name, kind), "")
            cause = (
                f"verifier {name!r} failed most, {int(count)} samples in the last step, mostly by "
                f"{kind}" + (f" ({example})" if example else "")
            )
        return InvalidRateError(
            f"reward/invalid_rate was above trainer.max_invalid_rate={self.max_rate} for "
            f"{self.patience} steps in a row (trainer.invalid_rate_patience); {cause}. The run "
            f"stopped; its last weights are in {checkpoint}. Fix the verifier, or raise "
            "trainer.max_invalid_rate (null never stops)."
        )
