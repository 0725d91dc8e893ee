"""Per-step data, throughput and memory metrics under verl's names."""

from __future__ import annotations

import torch

from mmrl.hybrid import Workers
from mmrl.protocol import Batch
from mmrl.utils.timing import peak_rss_gib


def _stats(prefix: str, values: torch.Tensor) -> dict[str, float]:
    if values.numel() == 0:
        return {}
    values = values.float()
    return {
        f"{prefix}/mean": float(values.mean()),
        f"{prefix}/max": float(values.max()),
        f"{prefix}/min": float(values.min()),
    }


def _correlation(x: torch.Tensor, y: torch.Tensor) -> float | None:
    """Pearson correlation of ``x`` and ``y`` [N]; None when either is constant or N < 2."""
    x, y = x.double() - x.double().mean(), y.double() - y.double().mean()
    denom = float((x.square().sum() * y.square().sum()).sqrt())
    return float((x * y).sum()) / denom if denom > 1e-12 else None


def compute_data_metrics(
    batch: Batch, step_time_s: float, gen_time_s: float | None = None
) -> dict[str, float]:
    """Scores, rewards, advantages, lengths, log-prob drift and throughput of one step.

    ``step_time_s``: wall time of the step's RL stages (generation to update), for
    ``perf/throughput`` (prompt and response tokens per second, all workers together) and
    ``perf/samples_per_s``. ``gen_time_s``: wall time of generation, for
    ``perf/rollout_tokens_per_s`` (sampled response tokens per second, over all workers).

    Token statistics use valid response tokens of valid samples only.
    """
    mask = batch["response_mask"].bool()
    valid = batch["valid_mask"].bool()
    token_mask = mask & valid.unsqueeze(-1)
    response_length = mask.sum(-1).float()
    prompt_length = batch["attention_mask"][:, : -mask.shape[1]].sum(-1).float()
    metrics = {
        **_stats("critic/score", batch["token_level_scores"].sum(-1)[valid]),
        **_stats("critic/rewards", batch["token_level_rewards"].sum(-1)[valid]),
        **_stats("critic/advantages", batch["advantages"][token_mask]),
        **_stats("critic/returns", batch["returns"][token_mask]),
        **_stats("response_length", response_length),
        **_stats("prompt_length", prompt_length),
        "response_length/clip_ratio": float(batch["response_clipped"].float().mean()),
    }
    if "values" in batch:
        metrics.update(_stats("critic/values", batch["values"][token_mask]))
    corr = _correlation(batch["token_level_scores"].sum(-1)[valid], response_length[valid])
    if corr is not None:  # a reward that pays for length shows here (the run doctor reads it)
        metrics["response_length/score_corr"] = corr
    # Rollout and training should agree on the sampled tokens' log-probs; a gap is
    # the classic silent bug of hybrid engines, so it is always reported (by the actor's
    # update when old log-probs come from its own forward pass).
    diff = torch.zeros(0)
    if "old_log_probs" in batch:
        diff = (batch["rollout_log_probs"] - batch["old_log_probs"]).abs()[mask]
    if diff.numel():
        metrics["rollout/logprob_diff_max"] = float(diff.max())
        metrics["rollout/logprob_diff_mean"] = float(diff.mean())
    num_tokens = float(batch["attention_mask"].sum())
    metrics["perf/total_num_tokens"] = num_tokens
    metrics["perf/throughput"] = num_tokens / max(step_time_s, 1e-9)
    metrics["perf/samples_per_s"] = len(batch) / max(step_time_s, 1e-9)
    if gen_time_s is not None:
        metrics["perf/rollout_tokens_per_s"] = float(mask.sum()) / max(gen_time_s, 1e-9)
    return metrics


def prompt_set_metrics(prompts: Batch) -> dict[str, float]:
    """What ``data.max_prompt_length`` did to the encoded training set: ``data/filtered_prompts``
    (dropped by ``data.filter_overlong_prompts``) and, where the processor truncates (VLM,
    ``data.truncation``), ``data/truncated_prompts``; each also as a share of all prompts
    (``*_frac``), which the run doctor reads."""
    filtered = int(prompts.meta.get("num_filtered_prompts", 0))
    total = len(prompts) + filtered
    metrics = {"data/filtered_prompts": filtered, "data/filtered_prompt_frac": filtered / total}
    if "num_truncated_prompts" in prompts.meta:
        truncated = int(prompts.meta["num_truncated_prompts"])
        metrics["data/truncated_prompts"] = truncated
        metrics["data/truncated_prompt_frac"] = truncated / total
    return metrics


def memory_metrics(workers: Workers) -> dict[str, float]:
    """Peak memory so far, in GiB, over the driver and every worker process.

    ``perf/max_memory_gib``: on GPU the largest peak of allocated GPU memory of any worker,
    else the largest peak resident memory (RSS) of any process. ``perf/max_rss_gib``: the
    largest peak RSS, on any device.
    """
    stats = [s for g in (workers.actor, workers.critic) if g is not None for s in g.memory_stats()]
    rss = max([peak_rss_gib(), *(s["peak_rss_gib"] for s in stats)])
    gpu = [s["cuda_peak_gib"] for s in stats if "cuda_peak_gib" in s]
    return {"perf/max_memory_gib": max(gpu) if gpu else rss, "perf/max_rss_gib": rss}
