"""The run report's charts: matplotlib figures rendered to PNG bytes (no pyplot, no display).

Every chart reads a run's history (one dict per logged step, ``step`` plus metrics) and
plots only the keys it finds, so an older or crashed run draws what it has.
"""

from __future__ import annotations

import io
import re
from dataclasses import dataclass

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

# Stages timed inside timing_s/step, and the ones outside it (validation, saving).
STEP_KEY = "timing_s/step"
VAL_CORE = re.compile(r"^val-core/.+/mean@\d+$")
MAX_LINES = 6  # lines per chart; more are unreadable


@dataclass(frozen=True)
class Curve:
    """One chart: its ``title``, the metric keys it draws (those present), what it shows."""

    title: str
    keys: tuple[str, ...]
    note: str


CURVES = (
    Curve("reward (training)", ("critic/score/mean",), "mean score of the step's samples"),
    Curve(
        "validation",
        ("val/score/mean", "val/greedy/score/mean"),
        "held-out score (val/*) and verl's val-core/<task>/<metric>/mean@N",
    ),
    Curve(
        "KL",
        ("actor/kl_loss", "actor/reward_kl_penalty", "actor/ppo_kl"),
        "to the reference (kl_loss, reward_kl_penalty) and to the rollout policy (ppo_kl)",
    ),
    Curve("entropy", ("actor/entropy",), "mean per-step entropy of the policy, nats"),
    Curve("clip fraction", ("actor/pg_clipfrac",), "share of tokens whose ratio was clipped"),
    Curve("grad norm", ("actor/grad_norm",), "before clipping"),
    Curve(
        "response length",
        ("response_length/mean", "response_length/max"),
        "steps (tokens or frames) per response",
    ),
    Curve(
        "invalid-sample rate",
        ("reward/invalid_rate",),
        "share of samples no verifier could score",
    ),
)


def series(history: list[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
    """``(steps, values)`` of ``key`` over the steps that logged a number for it."""
    pts = [
        (row["step"], row[key])
        for row in history
        if isinstance(row.get(key), int | float) and isinstance(row.get("step"), int)
    ]
    if not pts:
        return np.zeros(0), np.zeros(0)
    steps, values = zip(*pts, strict=True)
    return np.asarray(steps, dtype=float), np.asarray(values, dtype=float)


def curve_keys(curve: Curve, history: list[dict]) -> list[str]:
    """The keys of ``curve`` that ``history`` holds; the validation chart adds val-core keys."""
    present = {k for row in history for k in row}
    keys = [k for k in curve.keys if k in present]
    if curve.title == "validation":
        keys += sorted(k for k in present if VAL_CORE.match(k))
    return keys[:MAX_LINES]


def curve_png(curve: Curve, history: list[dict]) -> bytes | None:
    """The chart of ``curve`` as PNG bytes; None when the run logged none of its keys."""
    keys = curve_keys(curve, history)
    if not keys:
        return None
    fig = Figure(figsize=(4.2, 2.8), dpi=100)
    ax = fig.add_subplot()
    for key in keys:
        steps, values = series(history, key)
        style = {"marker": "o", "ms": 3} if len(steps) < 30 else {"lw": 1.2}
        ax.plot(steps, values, label=key, **style)
    ax.set_title(curve.title, fontsize=10)
    ax.set_xlabel("RL step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6)
    fig.tight_layout()
    return _png(fig)


def stage_keys(history: list[dict]) -> list[str]:
    """``timing_s/<stage>`` keys in the order a step first logged them, without the total and
    without sub-stages (``timing_s/reward/<verifier>`` is inside ``timing_s/reward``)."""
    keys: list[str] = []
    for row in history:
        keys += [
            k
            for k in row
            if k.startswith("timing_s/") and k.count("/") == 1 and k != STEP_KEY and k not in keys
        ]
    return keys


def stage_times_png(history: list[dict]) -> bytes | None:
    """A stacked bar per step of the seconds each stage took; None without timings."""
    keys = stage_keys(history)
    rows = [row for row in history if any(isinstance(row.get(k), int | float) for k in keys)]
    if not rows:
        return None
    fig = Figure(figsize=(8.4, 3.2), dpi=100)
    ax = fig.add_subplot()
    steps = np.asarray([row["step"] for row in rows], dtype=float)
    bottom = np.zeros(len(rows))
    colors = [f"C{i % 10}" for i in range(len(keys))]
    for key, color in zip(keys, colors, strict=True):
        values = np.asarray([float(row.get(key) or 0.0) for row in rows])
        ax.bar(steps, values, bottom=bottom, label=key.removeprefix("timing_s/"), color=color)
        bottom += values
    ax.set_title("time per stage", fontsize=10)
    ax.set_xlabel("RL step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("seconds")
    ax.legend(fontsize=6, ncol=2, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    return _png(fig)


def _png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()
