"""The run doctor: what is likely wrong with a run, read from its logged metrics.

The checks follow the data flow of a step, so the first finding is the one to fix first:
prompts, responses, rewards, KL and advantages, updates, then where the time goes. Each
:class:`Finding` names the metric that shows the problem and the mechanism behind it in plain
words. ``mmrl doctor RUN_DIR`` runs them on a finished (or crashed) run; during training
:class:`LiveDoctor` runs them after every step and warns once per check. Thresholds are
``trainer.doctor.*`` (:class:`mmrl.config.doctor.DoctorConfig`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from mmrl.config.doctor import DoctorConfig

log = logging.getLogger(__name__)

STAGES = ("prompts", "responses", "rewards", "kl and advantages", "updates", "timing")
KL_KEYS = ("actor/kl_loss", "actor/reward_kl_penalty", "actor/ppo_kl")
ERROR_METRICS = ("mae", "lpips")


@dataclass(frozen=True)
class Finding:
    """One problem: ``check`` (its name), the data-flow ``stage``, the ``metric`` that shows
    it, the ``step`` it was first seen at (None: from the end-of-run evaluation), and the
    ``message``: what the numbers say and the likely mechanism."""

    check: str
    stage: str
    metric: str
    step: int | None
    message: str

    def line(self) -> str:
        at = f" (step {self.step})" if self.step is not None else ""
        return f"[{self.stage}] {self.check}{at}: {self.message} Metric: {self.metric}."


def values(history: list[dict], key: str) -> tuple[list[int], np.ndarray]:
    """``(steps, values)`` of the steps >= 1 that logged a finite number for ``key``."""
    steps, vals = [], []
    for row in history:
        value, step = row.get(key), row.get("step", 0)
        if isinstance(value, int | float) and math.isfinite(value) and step >= 1:
            steps.append(step)
            vals.append(float(value))
    return steps, np.asarray(vals)


def _trend(history: list[dict], key: str, window: int) -> tuple[float, float, int] | None:
    """(first-window mean, last-window mean, last step) of ``key``; None before 2 windows."""
    steps, vals = values(history, key)
    if len(vals) < 2 * window:
        return None
    return float(vals[:window].mean()), float(vals[-window:].mean()), steps[-1]


# The training-set metrics of prompts over data.max_prompt_length: what happened to them, the
# setting that did it and what the policy then trains on.
OVERLONG_PROMPTS = {
    "data/filtered_prompt_frac": (
        "dropped",
        "data.filter_overlong_prompts=true",
        "the shorter prompts only, a skewed (often easier) task",
    ),
    "data/truncated_prompt_frac": (
        "truncated",
        "data.truncation",
        "questions with part of their text missing",
    ),
}


def check_overlong_prompts(history: list[dict], cfg: DoctorConfig) -> list[Finding]:
    found = []
    for key, (what, setting, left) in OVERLONG_PROMPTS.items():
        rows = [row for row in history if isinstance(row.get(key), int | float)]
        if not rows or rows[-1][key] <= cfg.max_overlong_prompt_frac:
            continue
        frac = float(rows[-1][key])
        found.append(
            Finding(
                f"prompts {what} for length",
                "prompts",
                key,
                rows[-1]["step"],
                f"{frac:.0%} of the training prompts were longer than data.max_prompt_length "
                f"and were {what} ({setting}; limit trainer.doctor.max_overlong_prompt_frac="
                f"{cfg.max_overlong_prompt_frac:g}): the policy trains on {left}. Raise "
                "data.max_prompt_length to fit the data.",
            )
        )
    return found


def check_logprob_drift(history: list[dict], cfg: DoctorConfig) -> list[Finding]:
    steps, vals = values(history, "rollout/logprob_diff_mean")
    over = [
        (s, v)
        for s, v in zip(steps[-cfg.window :], vals[-cfg.window :], strict=True)
        if v > cfg.max_logprob_diff
    ]
    if not over:
        return []
    step, value = over[0]
    return [
        Finding(
            "rollout log-probs drift",
            "responses",
            "rollout/logprob_diff_mean",
            step,
            f"the rollout engine's log-probs of the sampled tokens differ from the actor's "
            f"recomputed ones by {value:.3g} on average (limit {cfg.max_logprob_diff:g}): the "
            "update assumes a distribution the samples did not come from. Likely a stale or "
            "partial weight sync, a different temperature or sampling mask on one side, or a "
            "lower-precision rollout (bf16) beside fp32 training; fix the engine or set "
            "algorithm.rollout_is to correct for it.",
        )
    ]


def check_invalid_rate(history: list[dict], cfg: DoctorConfig) -> list[Finding]:
    trend = _trend(history, "reward/invalid_rate", cfg.window)
    if trend is None or trend[1] - trend[0] < cfg.invalid_rate_rise:
        return []
    first, last, step = trend
    return [
        Finding(
            "rising invalid-sample rate",
            "responses",
            "reward/invalid_rate",
            step,
            f"the share of samples no verifier could score rose from {first:.2f} to {last:.2f}: "
            "the policy drifts towards responses the verifiers cannot parse, or a verifier "
            "fails more often (timeouts, crashes: see reward/<verifier>/errors/*). Invalid "
            "samples teach nothing.",
        )
    ]


def check_reward_hacking(history: list[dict], cfg: DoctorConfig) -> list[Finding]:
    trend = _trend(history, "critic/score/mean", cfg.window)
    _, val = values(history, "val/score/mean")
    val_steps = [row for row in history if isinstance(row.get("val/score/mean"), int | float)]
    if trend is None or len(val_steps) < 2:
        return []
    first, last, step = trend
    train_rise = last - first
    val_rise = val_steps[-1]["val/score/mean"] - val_steps[0]["val/score/mean"]
    if train_rise < cfg.reward_rise or val_rise >= cfg.val_rise_fraction * train_rise:
        return []
    return [
        Finding(
            "training reward rises, validation does not",
            "rewards",
            "critic/score/mean vs val/score/mean",
            step,
            f"the training score rose by {train_rise:.3f} while the validation score moved by "
            f"{val_rise:+.3f}: the policy learned something the training verifiers pay for "
            "that validation (reward.val_verifiers) does not. Likely reward hacking or format "
            "gaming, or training and validation data that differ.",
        )
    ]


def check_length_bias(history: list[dict], cfg: DoctorConfig) -> list[Finding]:
    steps, vals = values(history, "response_length/score_corr")
    if len(vals) < cfg.window or vals[-cfg.window :].mean() <= cfg.max_length_score_corr:
        return []
    corr = float(vals[-cfg.window :].mean())
    return [
        Finding(
            "length bias",
            "rewards",
            "response_length/score_corr",
            steps[-1],
            f"a sample's score and its response length correlate at {corr:.2f} on average over "
            f"the last {cfg.window} steps: the reward pays for length, so the policy will grow "
            "(or shrink) its responses rather than get better. Check the verifier, and "
            "consider a length-normalised loss aggregation.",
        )
    ]


def check_zero_variance(history: list[dict], cfg: DoctorConfig) -> list[Finding]:
    steps, vals = values(history, "actor/zero_variance_frac")
    if len(vals) < cfg.window or vals[-cfg.window :].mean() <= cfg.max_zero_variance_frac:
        return []
    frac = float(vals[-cfg.window :].mean())
    return [
        Finding(
            "no learning signal in most groups",
            "rewards",
            "actor/zero_variance_frac",
            steps[-1],
            f"{frac:.0%} of the samples were in groups whose rewards were all equal over the "
            f"last {cfg.window} steps; their GRPO advantages are zero, so they teach nothing. "
            "actor_rollout_ref.rollout.n is too small, or the task is too easy (all right) or "
            "too hard (all wrong) for the policy.",
        )
    ]


def check_kl_spike(history: list[dict], cfg: DoctorConfig) -> list[Finding]:
    for key in KL_KEYS:
        steps, vals = values(history, key)
        for i, value in enumerate(vals):
            before = float(np.median(np.abs(vals[:i]))) if i >= 2 else None
            jump = before is not None and value > cfg.kl_spike_factor * before
            if value > cfg.kl_max or (jump and value > cfg.kl_max / 10):
                since = f" from a median of {before:.3g} before" if before is not None else ""
                return [
                    Finding(
                        "KL spike",
                        "kl and advantages",
                        key,
                        steps[i],
                        f"{key} reached {value:.3g}{since} (limit trainer.doctor.kl_max="
                        f"{cfg.kl_max:g}): one update moved the policy far. Likely a learning "
                        "rate too high, a sampling temperature the actor does not share, a ratio "
                        "that drifted (rollout vs recomputed log-probs) or advantages on a large "
                        "scale.",
                    )
                ]
    return []


def check_stage_shares(history: list[dict], cfg: DoctorConfig) -> list[Finding]:
    rows = [row for row in history if row.get("step", 0) >= 1 and row.get("timing_s/step")]
    if len(rows) > 1:
        rows = rows[1:]  # the first step also warms up (allocations, compilation)
    found = []
    for stage, limit in sorted(cfg.stage_shares.items()):
        key = f"timing_s/{stage}"
        shares = [row[key] / row["timing_s/step"] for row in rows if row.get(key) is not None]
        if not shares or float(np.median(shares)) <= limit:
            continue
        share = float(np.median(shares))
        found.append(
            Finding(
                f"stage {stage} takes {share:.0%} of the step",
                "timing",
                key,
                rows[-1]["step"],
                f"the {stage} stage took a median {share:.0%} of timing_s/step, more than its "
                f"share trainer.doctor.stage_shares.{stage}={limit:g}: it is the bottleneck "
                "(a slow verifier, an engine without batching, too small a batch).",
            )
        )
    return found


def check_worldmodel(eval_table: dict[str, Any] | None, cfg: DoctorConfig) -> list[Finding]:
    """Repetition and error growth per future step of the RL model's held-out evaluation
    (``worldmodel_eval.json``: ``{model: {decoding: metrics}}``)."""
    found = []
    for decoding, m in sorted((eval_table or {}).get("rl", {}).items()):
        rep = m.get("repetition")
        if isinstance(rep, float) and math.isfinite(rep) and rep > cfg.max_repetition:
            found.append(
                Finding(
                    "world model repeats its last frame",
                    "responses",
                    f"worldmodel_eval.json rl/{decoding}/repetition",
                    None,
                    f"{rep:.0%} of the predicted frames stand still where the true frame moves "
                    f"({decoding} decoding): the model copies the last context frame when "
                    "unsure, a maximum-likelihood habit. Give the repetition_penalty verifier "
                    "a weight.",
                )
            )
        future = sum(1 for k in m if k.startswith("mae@t"))
        for name in ERROR_METRICS if future > 1 else ():
            first, last = m.get(f"{name}@t1"), m.get(f"{name}@t{future}")
            if not (isinstance(first, float) and isinstance(last, float)) or first <= 0:
                continue
            if last > cfg.max_error_growth * first:
                found.append(
                    Finding(
                        "error grows with the future step",
                        "responses",
                        f"worldmodel_eval.json rl/{decoding}/{name}@t1..t{future}",
                        None,
                        f"held-out {name} grows from {first:.3g} at t=1 to {last:.3g} at "
                        f"t={future} ({decoding}): each predicted frame feeds the next, so "
                        "errors compound (long-horizon drift). Reward the later frames "
                        "(frame aggregation) or train on longer futures.",
                    )
                )
                break
    return found


def check_val_repetition(history: list[dict], cfg: DoctorConfig) -> list[Finding]:
    steps, vals = values(history, "val/repetition_penalty/rate")
    if not len(vals) or vals[-1] <= cfg.max_repetition:
        return []
    return [
        Finding(
            "world model repeats its last frame",
            "responses",
            "val/repetition_penalty/rate",
            steps[-1],
            f"{vals[-1]:.0%} of the validation predictions stand still where the truth moves: "
            "the model copies its last context frame.",
        )
    ]


HISTORY_CHECKS: tuple[Callable[[list[dict], DoctorConfig], list[Finding]], ...] = (
    check_overlong_prompts,
    check_logprob_drift,
    check_invalid_rate,
    check_val_repetition,
    check_reward_hacking,
    check_length_bias,
    check_zero_variance,
    check_kl_spike,
    check_stage_shares,
)


def diagnose(
    history: list[dict], cfg: DoctorConfig, eval_table: dict[str, Any] | None = None
) -> list[Finding]:
    """Every finding of a run, in data-flow order (:data:`STAGES`)."""
    found = [f for check in HISTORY_CHECKS for f in check(history, cfg)]
    found += check_worldmodel(eval_table, cfg)
    return sorted(found, key=lambda f: STAGES.index(f.stage))


class LiveDoctor:
    """Runs the history checks after each logged step and warns once per check."""

    def __init__(self, cfg: DoctorConfig) -> None:
        self.cfg, self.warned = cfg, set()
        self.findings: list[Finding] = []

    def observe(self, history: list[dict]) -> list[Finding]:
        """The new findings of ``history`` (all steps so far), each logged as a warning."""
        if not self.cfg.live:
            return []
        new = [f for f in diagnose(history, self.cfg) if f.check not in self.warned]
        for finding in new:
            self.warned.add(finding.check)
            log.warning("doctor: %s", finding.line())
        self.findings += new
        return new
