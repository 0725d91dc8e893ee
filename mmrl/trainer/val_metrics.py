"""Validation metrics over N samples per prompt, under verl's names and with verl's meaning.

For each prompt and each per-sample variable (``reward``, the summed validation score, and
each verifier's own score), its N values give:

- ``mean@N`` and ``std@N``: their mean and (population) standard deviation;
- ``best@k/mean``, ``best@k/std``: the best of k values drawn with replacement from the N,
  averaged over bootstrap draws (``/std`` is the spread of those draws);
- ``worst@k/...``: the same for the worst of k;
- ``maj@k/...``: the value of the majority answer among k draws (ties go to the answer drawn
  first; its value is that of its first draw), when the samples have answers (text).

k runs over 2, 4, 8, ... below N, and N itself. Each metric is then averaged over the
prompts of a data source (the task). The headline numbers, ``mean``, ``best`` and ``maj`` at
the largest N of the ``reward`` variable, are ``val-core/<source>/reward/<metric>``; every
other is ``val-aux/<source>/<variable>/<metric>``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import numpy as np

N_BOOTSTRAP = 1000
CORE_VARIABLE = "reward"
CORE_METRICS = ("mean", "best", "maj")


def subset_sizes(n: int) -> list[int]:
    """2, 4, 8, ... below ``n``, then ``n`` (nothing for ``n == 1``)."""
    sizes, k = [], 2
    while k < n:
        sizes.append(k)
        k *= 2
    return [*sizes, n] if n > 1 else []


def majority_values(values: np.ndarray, answers: np.ndarray) -> np.ndarray:
    """Per row, the value of the most frequent answer (ties: the one that comes first; its
    value is that of its first occurrence).

    Args:
        values: float [R, k].
        answers: int [R, k], equal ints are equal answers.

    Returns:
        float [R].
    """
    votes = (answers[:, :, None] == answers[:, None, :]).sum(-1)  # [R, k]: votes of each answer
    # The first position holding a most-voted answer is that answer's first occurrence, and no
    # other most-voted answer occurs before it.
    first = (votes == votes.max(1, keepdims=True)).argmax(1)
    return values[np.arange(len(values)), first]


def prompt_metrics(
    values: np.ndarray,
    answers: np.ndarray | None,
    seed: int,
    n_bootstrap: int = N_BOOTSTRAP,
) -> dict[str, float]:
    """The metrics of one prompt's N samples (see the module docstring).

    Args:
        values: float [N], one per sample.
        answers: int [N] (equal ints are equal answers) or None (no ``maj@k``).
        seed: seeds the bootstrap draws, so a prompt's metrics do not depend on the others.
    """
    n = len(values)
    out = {f"mean@{n}": float(values.mean())}
    if n == 1:
        return out
    out[f"std@{n}"] = float(values.std())
    rng = np.random.default_rng(seed)
    for k in subset_sizes(n):
        draws = rng.integers(0, n, size=(n_bootstrap, k))
        drawn = values[draws]
        stats = {"best": drawn.max(1), "worst": drawn.min(1)}
        if answers is not None:
            stats["maj"] = majority_values(drawn, answers[draws])
        for name, per_draw in stats.items():
            out[f"{name}@{k}/mean"] = float(per_draw.mean())
            out[f"{name}@{k}/std"] = float(per_draw.std())
    return out


def answer_codes(answers: Sequence[str]) -> np.ndarray:
    """int [B]: equal answers get equal codes."""
    _, codes = np.unique(np.asarray([str(a) for a in answers], dtype=object), return_inverse=True)
    return codes.reshape(-1)


def validation_metrics(
    sources: Sequence[str],
    prompt_ids: Sequence[int],
    variables: dict[str, np.ndarray],
    answers: Sequence[str] | None = None,
    seed: int = 42,
    n_bootstrap: int = N_BOOTSTRAP,
) -> dict[str, float]:
    """``val-core/...`` and ``val-aux/...`` metrics of a validation pass.

    Args:
        sources: [B] the data source of each sample (the task's name).
        prompt_ids: [B] which prompt each sample answers; a prompt's samples form its group.
        variables: name -> float [B], e.g. ``{"reward": scores}``.
        answers: [B] each sample's final answer, for ``maj@k``; None without answers.
        seed: bootstrap seed.
    """
    codes = answer_codes(answers) if answers is not None else None
    groups: dict[tuple[str, int], list[int]] = defaultdict(list)
    for row, (source, pid) in enumerate(zip(sources, prompt_ids, strict=True)):
        groups[(str(source), int(pid))].append(row)
    # source -> variable -> metric -> per-prompt values
    collected: dict[str, dict[str, dict[str, list[float]]]] = defaultdict(
        lambda: defaultdict(lambda: defaultdict(list))
    )
    for (source, _), rows in groups.items():
        idx = np.asarray(rows)
        for name, values in variables.items():
            metrics = prompt_metrics(
                np.asarray(values, dtype=np.float64)[idx],
                codes[idx] if codes is not None else None,
                seed,
                n_bootstrap,
            )
            for metric, value in metrics.items():
                collected[source][name][metric].append(value)
    out = {}
    for source, by_variable in collected.items():
        for name, by_metric in by_variable.items():
            n_max = max(_samples_of(metric) for metric in by_metric)
            for metric, per_prompt in by_metric.items():
                core = (
                    name == CORE_VARIABLE
                    and metric.startswith(CORE_METRICS)
                    and _samples_of(metric) == n_max
                )
                section = "val-core" if core else "val-aux"
                out[f"{section}/{source}/{name}/{metric}"] = float(np.mean(per_prompt))
    return out


def _samples_of(metric: str) -> int:
    """``best@4/mean`` -> 4."""
    return int(metric.split("@")[1].split("/")[0])
