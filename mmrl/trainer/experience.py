"""One RL step's experience, up to the update: generate, score, log-probs, KL reward,
importance weights, advantages (the first stages of DESIGN.md's data flow)."""

from __future__ import annotations

import numpy as np
import torch

from mmrl import algos
from mmrl.config import RunConfig, old_log_prob_source
from mmrl.errors import ConfigError
from mmrl.hybrid import WorkerGroup
from mmrl.processors.base import PromptProcessor
from mmrl.protocol import Batch
from mmrl.sampling import FRAME_END_KEY, SEEDS_KEY, SamplingParams, row_seeds
from mmrl.utils.timing import timer
from mmrl.verifiers import VerifierOutput, VerifierRunner


def apply_scores(
    batch: Batch, out: VerifierOutput, cfg: RunConfig
) -> tuple[Batch, dict[str, float]]:
    """Place each sample's score on its last valid step (``token_level_scores`` [B, T]); per-frame
    scores [B, F] go on each frame's last step (``frame_end_steps`` [B, F])."""
    scores = torch.as_tensor(out.scores, dtype=torch.float32)
    if cfg.reward.overlong_reward == "zero":
        clipped = batch["response_clipped"].view(-1, *[1] * (scores.ndim - 1))
        scores = torch.where(clipped, torch.zeros_like(scores), scores)
    elif cfg.reward.overlong_reward != "keep":
        raise ConfigError(
            f"reward.overlong_reward={cfg.reward.overlong_reward!r}: expected 'keep' or 'zero'"
        )
    mask = batch["response_mask"]
    token_scores = torch.zeros_like(mask)
    if scores.ndim == 2:
        token_scores.scatter_(1, frame_ends(batch, scores.shape[1]), scores)
    else:
        # the last valid step, not mask.sum() - 1: teacher-forced steps are holes in the mask
        steps = torch.arange(mask.shape[1], device=mask.device)
        last = torch.where(mask.bool(), steps, 0).max(-1).values
        token_scores[torch.arange(len(batch)), last] = scores
    batch["token_level_scores"] = token_scores * mask
    batch["valid_mask"] = torch.as_tensor(out.valid)
    return batch, {k: float(np.mean(v)) for k, v in out.metrics.items()}


def reward_components(
    batch: Batch, out: VerifierOutput, runner: VerifierRunner, cfg: RunConfig
) -> dict[str, torch.Tensor]:
    """Each weighted verifier's own per-sample score (``reward_components`` [B, K]) and its
    weight (``reward_weights`` [K]), for estimators that normalise rewards one by one (gdpo).
    A sample that ``overlong_reward=zero`` zeroes scores 0 on every reward, as in the sum."""
    weighted = [v for v in runner.verifiers if v.weight != 0.0]
    if not weighted:
        raise ConfigError(
            "algorithm.adv_estimator=gdpo needs a reward.verifiers entry with a nonzero weight"
        )
    columns = [torch.as_tensor(out.verifier_scores[v.name], dtype=torch.float32) for v in weighted]
    components = torch.stack(columns, 1)
    if cfg.reward.overlong_reward == "zero":
        components = components * ~batch["response_clipped"].bool()[:, None]
    weights = torch.tensor([v.weight for v in weighted], dtype=torch.float32)
    return {"reward_components": components, "reward_weights": weights}


def frame_ends(batch: Batch, frames: int) -> torch.Tensor:
    """``frame_end_steps`` int64 [B, F], checked against per-frame scores for ``frames`` frames."""
    if FRAME_END_KEY not in batch:
        raise ValueError(
            f"a verifier returned per-frame scores [B, {frames}], but the task's prompts do not "
            f"mark where frames end ({FRAME_END_KEY}); use a per-sample aggregation (mean, last, "
            "discounted)"
        )
    ends = batch[FRAME_END_KEY].long()
    if ends.shape[1] != frames:
        raise ValueError(
            f"a verifier returned scores for {frames} frames per sample; responses hold "
            f"{ends.shape[1]}"
        )
    return ends


def score(
    batch: Batch, processor: PromptProcessor, cfg: RunConfig, runner: VerifierRunner
) -> tuple[Batch, dict[str, float]]:
    """Decode responses, run the verifiers, place each score on its last valid step."""
    batch = processor.decode(batch)
    return apply_scores(batch, runner.run(batch), cfg)


def sampling_params(
    cfg: RunConfig,
    processor: PromptProcessor,
    seed: int,
    validate: bool = False,
    greedy: bool = False,
) -> SamplingParams:
    """Sampling as ``rollout`` (or ``rollout.val_kwargs``) says, under the processor's
    constraints."""
    r = cfg.actor_rollout_ref.rollout
    params = {
        "max_tokens": cfg.data.max_response_length,
        "temperature": r.val_kwargs.temperature if validate else r.temperature,
        "top_p": r.top_p,
        "top_k": r.top_k,
        "do_sample": (r.val_kwargs.do_sample if validate else r.do_sample) and not greedy,
        "seed": seed,
        **processor.sampling_overrides(),
    }
    return SamplingParams(**params)


def with_row_seeds(prompts: Batch, seed: int) -> Batch:
    """``prompts`` with each row's sampling seed (``sample_seeds``), drawn over the whole batch
    before the worker group splits it: a row samples the same response at any worker count."""
    prompts[SEEDS_KEY] = row_seeds(seed, len(prompts))
    return prompts


def needs_critic(cfg: RunConfig) -> bool:
    """The advantage estimator reads value estimates (GAE)."""
    return algos.ADV_ESTIMATORS.trait(cfg.algorithm.adv_estimator, "needs_critic", False)


def needs_reference(cfg: RunConfig) -> bool:
    """A KL loss or a KL reward compares the actor with the frozen reference policy."""
    return cfg.actor_rollout_ref.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward


def step_seed(cfg: RunConfig, step: int) -> int:
    """The sampling seed of RL step ``step``."""
    return cfg.trainer.seed * 1_000_003 + step


def make_experience(
    cfg: RunConfig,
    step: int,
    prompts: Batch,
    worker: WorkerGroup,
    critic: WorkerGroup | None,
    processor: PromptProcessor,
    kl_ctrl,
    runner: VerifierRunner,
    metrics: dict[str, float],
) -> Batch:
    """Step ``step``'s batch up to the update: responses, scores, old and reference log-probs,
    rewards, advantages (and values and importance weights when configured).

    Timings and statistics go into ``metrics``.
    """
    algo, n = cfg.algorithm, cfg.actor_rollout_ref.rollout.n
    seed = step_seed(cfg, step)
    prompts["uid"] = np.asarray([f"{step}-{i}" for i in range(len(prompts))], dtype=object)
    with timer("gen", metrics):
        batch = worker.generate_sequences(
            with_row_seeds(prompts.repeat(n, interleave=True), seed),
            sampling_params(cfg, processor, seed),
        )
    with timer("reward", metrics):  # verifiers run in the background during old log-probs
        pending = runner.submit(processor.decode(batch))
    baselines = None
    if algos.ADV_ESTIMATORS.trait(algo.adv_estimator, "needs_baselines", False):
        with timer("gen_max", metrics):
            greedy = worker.generate_sequences(
                prompts, sampling_params(cfg, processor, seed, greedy=True)
            )
            greedy, _ = score(greedy, processor, cfg, runner)
            baselines = greedy["token_level_scores"].sum(-1).repeat_interleave(n)
    source = old_log_prob_source(cfg)
    if source == "recompute":
        with timer("old_log_prob", metrics):
            batch["old_log_probs"] = worker.compute_log_prob(batch)
    elif source == "rollout":
        batch["old_log_probs"] = batch["rollout_log_probs"]
    # else (on-policy) the update's own forward pass gives them, logs the rollout gap and
    # weighs by rollout_is from there
    if algo.rollout_is and "old_log_probs" in batch:
        batch["rollout_is_weights"], is_metrics = algos.rollout_is_weights(
            batch["old_log_probs"],
            batch["rollout_log_probs"],
            batch["response_mask"],
            algo.rollout_is,
            algo.rollout_is_cap,
        )
        metrics.update(is_metrics)
    with timer("reward", metrics):  # adds only the verifier time not hidden above
        scored = pending.result()
        batch, reward_metrics = apply_scores(batch, scored, cfg)
        metrics.update(reward_metrics)
    components = (
        reward_components(batch, scored, runner, cfg)
        if algos.ADV_ESTIMATORS.trait(algo.adv_estimator, "needs_components", False)
        else {}
    )
    if needs_reference(cfg):
        with timer("ref", metrics):
            batch["ref_log_prob"] = worker.compute_ref_log_prob(batch)
    if critic is not None:
        with timer("values", metrics):
            batch["values"] = critic.compute_values(batch)
    with timer("adv", metrics):
        if algo.use_kl_in_reward:
            rewards, kl_metrics = algos.apply_kl_penalty(
                batch["token_level_scores"],
                batch["old_log_probs"],
                batch["ref_log_prob"],
                batch["response_mask"],
                kl_ctrl,
                algo.kl_penalty,
                valid_mask=batch["valid_mask"],  # invalid samples stay out of the KL statistic
            )
            metrics.update(kl_metrics)
        else:
            rewards = batch["token_level_scores"]
        batch["token_level_rewards"] = rewards
        batch["advantages"], batch["returns"] = algos.get_adv_estimator(algo.adv_estimator)(
            token_level_rewards=rewards,
            response_mask=batch["response_mask"],
            valid_mask=batch["valid_mask"],
            index=batch["uid"],
            config=algo,
            values=batch["values"] if critic is not None else None,
            reward_baselines=baselines,
            **components,
        )
    return batch
