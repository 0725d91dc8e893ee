"""Golden values from verl's own algorithm core (verl 0.9.1, ``verl.trainer.ppo.core_algos``).

mmrl's ``mmrl.algos`` must compute what verl computes on the same inputs, except for
the conventions listed in docs/algorithms.md. ``tests/test_verl_golden.py`` compares
mmrl against the inputs and outputs this script writes. Run it in a scratch
environment, never in mmrl's venv (verl is not a dependency of mmrl):

    python3.11 -m venv /tmp/verl-venv
    /tmp/verl-venv/bin/pip install -r scripts/verl_golden/requirements.txt
    /tmp/verl-venv/bin/pip install --no-deps verl==0.9.1
    /tmp/verl-venv/bin/python scripts/verl_golden/make_golden.py tests/data/verl_golden.json

Every input is seeded and built here; every output is what a verl function returned.
All tensors are float64, so that rounding noise stays far below the test's tolerance and
any difference the test sees is a difference of formula. Inputs are rounded to 4 decimals
to keep the file small. Every sample is valid and has at least one response step (verl
has no ``valid_mask``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
import verl
import verl.utils.torch_functional as verl_F
from verl.trainer.config import AlgoConfig
from verl.trainer.ppo import core_algos
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_weights
from verl.workers.config import ActorConfig, PolicyLossConfig

COMMAND = "/tmp/verl-venv/bin/python scripts/verl_golden/make_golden.py tests/data/verl_golden.json"
SEED = 0
DTYPE = torch.float64
AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_KINDS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")

gen = torch.Generator().manual_seed(SEED)


def rounded(x: torch.Tensor) -> torch.Tensor:
    return torch.round(x.to(DTYPE) * 1e4) / 1e4


def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return rounded(torch.randn(*shape, generator=gen, dtype=DTYPE) * scale)


def uniform(lo: float, hi: float, *shape: int) -> torch.Tensor:
    return rounded(lo + (hi - lo) * torch.rand(*shape, generator=gen, dtype=DTYPE))


def tolist(x) -> list | float:
    if isinstance(x, torch.Tensor):
        return x.detach().to(DTYPE).tolist()
    return float(x)


def padded_mask(lengths: list[int], t: int) -> torch.Tensor:
    """[B, t] right-padded response mask."""
    return (torch.arange(t)[None, :] < torch.tensor(lengths)[:, None]).to(DTYPE)


def random_lengths(b: int, t: int) -> list[int]:
    lengths = torch.randint(1, t + 1, (b,), generator=gen).tolist()
    lengths[0] = t  # at least one full-length response
    return lengths


def interior_mask(b: int, t: int) -> torch.Tensor:
    """Padded mask with masked steps inside responses (observation tokens of a multi-turn run)."""
    mask = padded_mask(random_lengths(b, t), t)
    holes = torch.rand(b, t, generator=gen) < 0.25
    holes[:, 0] = False  # every response keeps its first step
    return mask * (~holes).to(DTYPE)


# --------------------------------------------------------------------------- advantages


def outcome_batch(sizes: list[int], patterns: list[str], t: int, shuffle: bool) -> dict:
    """Groups of responses with one sequence score each, placed on the last response step.

    patterns per group: ``binary`` (0/1 scores), ``continuous`` (normal), ``equal`` (one value).
    """
    uids, scores = [], []
    for g, (n, pattern) in enumerate(zip(sizes, patterns, strict=True)):
        uids += [f"prompt-{g}"] * n
        if pattern == "binary":
            s = (torch.rand(n, generator=gen) < 0.5).to(DTYPE)
        elif pattern == "equal":
            s = torch.full((n,), 0.7, dtype=DTYPE)
        else:
            s = randn(n)
        scores += s.tolist()
    b = len(uids)
    order = torch.randperm(b, generator=gen).tolist() if shuffle else list(range(b))
    uids, scores = [uids[i] for i in order], [scores[i] for i in order]
    lengths = random_lengths(b, t)
    rewards = torch.zeros(b, t, dtype=DTYPE)
    for i, (s, n) in enumerate(zip(scores, lengths, strict=True)):
        rewards[i, n - 1] = s
    return {"token_level_rewards": rewards, "response_mask": padded_mask(lengths, t), "index": uids}


def token_batch(b: int, t: int, holes: bool) -> dict:
    """Dense per-step rewards (zero outside the mask), an outcome score, critic values."""
    mask = interior_mask(b, t) if holes else padded_mask(random_lengths(b, t), t)
    rewards = randn(b, t, scale=0.3) * mask
    last = (mask * torch.arange(1, t + 1)).argmax(-1)
    rewards[torch.arange(b), last] += randn(b)
    return {
        "token_level_rewards": rewards,
        "response_mask": mask,
        "values": randn(b, t),
        "reward_baselines": randn(b),
    }


def verl_advantage(estimator: str, inputs: dict, cfg: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Call verl's estimator the way verl's ``ray_trainer.compute_advantage`` calls it."""
    rewards, mask = inputs["token_level_rewards"].clone(), inputs["response_mask"]
    algo = AlgoConfig(
        gamma=cfg.get("gamma", 1.0),
        lam=cfg.get("lam", 1.0),
        norm_adv_by_std_in_grpo=cfg.get("norm_adv_by_std_in_grpo", True),
    )
    if estimator == "gae":
        return core_algos.compute_gae_advantage_return(
            token_level_rewards=rewards,
            values=inputs["values"],
            response_mask=mask,
            gamma=algo.gamma,
            lam=algo.lam,
        )
    if estimator == "grpo":
        return core_algos.compute_grpo_outcome_advantage(
            token_level_rewards=rewards,
            response_mask=mask,
            index=np.array(inputs["index"], dtype=object),
            norm_adv_by_std_in_grpo=algo.norm_adv_by_std_in_grpo,
        )
    kwargs = {"token_level_rewards": rewards, "response_mask": mask, "config": algo}
    if "index" in inputs:
        kwargs["index"] = np.array(inputs["index"], dtype=object)
    if estimator == "remax":
        kwargs["reward_baselines"] = inputs["reward_baselines"]
    return core_algos.get_adv_estimator_fn(estimator)(**kwargs)


def advantage_cases() -> list[dict]:
    outcome = {
        "groups_mixed_shuffled": outcome_batch(
            [4, 4, 3, 5, 2, 8],
            ["binary", "continuous", "equal", "binary", "continuous", "continuous"],
            t=8,
            shuffle=True,
        ),
        "one_group_binary": outcome_batch([8], ["binary"], t=5, shuffle=False),
        "groups_with_singletons": outcome_batch(
            [1, 3, 1, 4, 2], ["continuous", "binary", "continuous", "continuous", "equal"], 6, False
        ),
    }
    # The same batch with each lone sample's score set to 0: what mmrl's convention (a
    # group with one sample has no baseline, so no advantage) gives on the original batch.
    lone = outcome["groups_with_singletons"]
    counts = {u: lone["index"].count(u) for u in lone["index"]}
    zeroed = torch.tensor([counts[u] > 1 for u in lone["index"]], dtype=DTYPE)[:, None]
    outcome["groups_with_singletons_lone_scores_zeroed"] = {
        **lone,
        "token_level_rewards": lone["token_level_rewards"] * zeroed,
    }
    token = {
        "padded": token_batch(6, 8, holes=False),
        "interior_mask": token_batch(7, 9, holes=True),
    }
    runs = []
    for batch_name, inputs in outcome.items():
        for norm in (True, False):
            runs.append(("grpo", batch_name, inputs, {"norm_adv_by_std_in_grpo": norm}))
        runs.append(("rloo", batch_name, inputs, {}))
        runs.append(("reinforce_plus_plus_baseline", batch_name, inputs, {}))
    for batch_name, inputs in token.items():
        for gamma, lam in ((1.0, 1.0), (0.99, 0.95), (0.9, 0.8)):
            runs.append(("gae", batch_name, inputs, {"gamma": gamma, "lam": lam}))
        for gamma in (1.0, 0.9):
            runs.append(("reinforce_plus_plus", batch_name, inputs, {"gamma": gamma}))
        for gamma in (1.0, 0.9):  # verl's ReMax reads no gamma
            runs.append(("remax", batch_name, inputs, {"gamma": gamma}))
    cases = []
    for estimator, batch_name, inputs, cfg in runs:
        adv, returns = verl_advantage(estimator, inputs, cfg)
        knobs = "-".join(f"{k}={v}" for k, v in cfg.items())
        cases.append(
            {
                "id": f"{estimator}/{batch_name}" + (f"/{knobs}" if knobs else ""),
                "estimator": estimator,
                "config": cfg,
                "inputs": {k: tolist(v) if k != "index" else v for k, v in inputs.items()},
                "advantages": tolist(adv),
                "returns": tolist(returns),
            }
        )
    return cases


# --------------------------------------------------------------------------- losses


def agg_loss_cases() -> list[dict]:
    loss_mat = randn(6, 7)
    mask = padded_mask([7, 3, 1, 5, 0, 6], 7)  # row 4 has no step: excluded by the seq modes
    cases = []
    for mode in AGG_MODES:
        out = core_algos.agg_loss(loss_mat=loss_mat, loss_mask=mask, loss_agg_mode=mode)
        cases.append({"id": mode, "mode": mode, "norm_constant": None, "loss": tolist(out)})
    mode = "seq-mean-token-sum-norm"
    out = core_algos.agg_loss(loss_mat, mask, mode, loss_scale_factor=16)
    cases.append({"id": f"{mode}/16", "mode": mode, "norm_constant": 16, "loss": tolist(out)})
    return [{"loss_mat": tolist(loss_mat), "loss_mask": tolist(mask), "cases": cases}]


def actor_config(loss_mode: str, agg: str, low: float, high: float, c: float = 3.0):
    """verl's actor config with only the fields the loss functions read set."""
    return ActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=1,
        clip_ratio_low=low,
        clip_ratio_high=high,
        clip_ratio_c=c,
        loss_agg_mode=agg,
        policy_loss=PolicyLossConfig(loss_mode=loss_mode),
    )


def policy_inputs(b: int, t: int, log_ratio: torch.Tensor) -> dict:
    mask = padded_mask(random_lengths(b, t), t)
    log_prob = uniform(-3.0, -0.05, b, t)
    return {
        "old_log_prob": rounded(log_prob - log_ratio),
        "log_prob": log_prob,
        "advantages": randn(b, t),
        "response_mask": mask,
    }


def verl_policy_loss(loss_mode: str, inputs: dict, cfg: dict, is_weights=None) -> dict:
    log_prob = inputs["log_prob"].clone().requires_grad_(True)
    config = actor_config(loss_mode, cfg["loss_agg_mode"], cfg["low"], cfg["high"], cfg["c"])
    loss, metrics = core_algos.get_policy_loss_fn(loss_mode)(
        old_log_prob=inputs["old_log_prob"],
        log_prob=log_prob,
        advantages=inputs["advantages"],
        response_mask=inputs["response_mask"],
        loss_agg_mode=config.loss_agg_mode,
        config=config,
        rollout_is_weights=is_weights,
    )
    loss.backward()
    return {
        "loss": tolist(loss),
        "grad_log_prob": tolist(log_prob.grad),
        "metrics": {k.removeprefix("actor/"): float(v) for k, v in metrics.items()},
    }


def policy_loss_cases() -> list[dict]:
    # Ratios from 0.2 to 5: both PPO clip sides, and the dual clip (ratio > c with A < 0).
    ppo = policy_inputs(8, 8, uniform(-1.6, 1.6, 8, 8))
    # GSPO's clip range is about 1e-4 wide: sequence ratios inside it and on both sides.
    seq_offset = torch.tensor([-1e-3, -3e-4, -1e-4, 0.0, 1e-4, 3e-4, 1e-3], dtype=DTYPE)
    gspo = policy_inputs(7, 6, seq_offset[:, None] + randn(7, 6, scale=2e-4))
    # A sequence log ratio above verl's GSPO clamp (10), with a negative advantage.
    far = policy_inputs(3, 4, torch.tensor([[12.0] * 4, [0.5] * 4, [-12.0] * 4], dtype=DTYPE))
    far["advantages"] = torch.tensor([[-1.0] * 4, [-0.5] * 4, [1.0] * 4], dtype=DTYPE)
    weights = uniform(0.3, 2.0, 8, 8)
    runs = []
    for agg in AGG_MODES:
        runs.append(("vanilla", "ppo", ppo, {"low": 0.2, "high": 0.28, "c": 3.0}, agg, None))
    runs.append(("vanilla", "ppo", ppo, {"low": 0.2, "high": 0.2, "c": 10.0}, "token-mean", None))
    runs.append(("vanilla", "ppo", ppo, {"low": 0.2, "high": 0.28, "c": 3.0}, "token-mean", True))
    for agg in ("seq-mean-token-mean", "token-mean"):
        runs.append(("gspo", "gspo", gspo, {"low": 3e-4, "high": 4e-4, "c": 3.0}, agg, None))
    runs.append(("gspo", "far", far, {"low": 3e-4, "high": 4e-4, "c": 3.0}, "token-mean", None))
    for agg in ("token-mean", "seq-mean-token-sum-norm"):
        runs.append(("cispo", "ppo", ppo, {"low": 0.2, "high": 0.28, "c": 3.0}, agg, None))
    # clip_ratio_low = 1 puts CISPO's lower bound at 0: no lower bound, as mmrl's None.
    runs.append(("cispo", "ppo", ppo, {"low": 1.0, "high": 4.0, "c": 3.0}, "token-mean", None))
    inputs_by_name = {"ppo": ppo, "gspo": gspo, "far": far}
    cases = []
    for loss_mode, batch_name, inputs, clip, agg, with_weights in runs:
        cfg = {**clip, "loss_agg_mode": agg}
        out = verl_policy_loss(loss_mode, inputs, cfg, weights if with_weights else None)
        knobs = f"low={clip['low']}-high={clip['high']}-c={clip['c']}"
        cases.append(
            {
                "id": f"{loss_mode}/{batch_name}/{agg}/{knobs}" + ("/is" if with_weights else ""),
                "loss_mode": loss_mode,
                "inputs": batch_name,
                "config": cfg,
                "rollout_is_weights": tolist(weights) if with_weights else None,
                **out,
            }
        )
    inputs = {k: {n: tolist(v) for n, v in d.items()} for k, d in inputs_by_name.items()}
    return [{"inputs": inputs, "cases": cases}]


def value_loss_cases() -> list[dict]:
    b, t = 6, 7
    mask = padded_mask(random_lengths(b, t), t)
    values, returns = randn(b, t), randn(b, t)
    vpreds = rounded(values + randn(b, t, scale=0.5))
    cases = []
    for clip in (0.2, 0.5):
        for mode in AGG_MODES:
            v = vpreds.clone().requires_grad_(True)
            loss, clipfrac = core_algos.compute_value_loss(
                vpreds=v,
                returns=returns,
                values=values,
                response_mask=mask,
                cliprange_value=clip,
                loss_agg_mode=mode,
            )
            loss.backward()
            cases.append(
                {
                    "id": f"{mode}/clip={clip}",
                    "cliprange_value": clip,
                    "loss_agg_mode": mode,
                    "loss": tolist(loss),
                    "vf_clipfrac": tolist(clipfrac),
                    "grad_vpreds": tolist(v.grad),
                }
            )
    inputs = {"vpreds": vpreds, "returns": returns, "values": values, "response_mask": mask}
    return [{"inputs": {k: tolist(v) for k, v in inputs.items()}, "cases": cases}]


# --------------------------------------------------------------------------- KL, IS, stats


def kl_cases() -> list[dict]:
    ref = uniform(-4.0, -0.05, 5, 6)
    diff = uniform(-3.0, 3.0, 5, 6)
    diff[0, :4] = torch.tensor([25.0, -25.0, 8.0, -12.0], dtype=DTYPE)  # hit both clamps
    log_prob = rounded(ref + diff)
    cases = []
    for kind in KL_KINDS:
        lp = log_prob.clone().requires_grad_(True)
        kl = core_algos.kl_penalty(lp, ref, kind)
        kl.sum().backward()
        cases.append({"id": kind, "kind": kind, "kl": tolist(kl), "grad_log_prob": tolist(lp.grad)})
    inputs = {"log_prob": tolist(log_prob), "ref_log_prob": tolist(ref)}
    updates = [(0.02, 64), (0.3, 64), (0.06, 128), (0.0, 32)]
    ctrl = core_algos.AdaptiveKLController(init_kl_coef=0.2, target_kl=0.05, horizon=1000)
    coefs = []
    for kl_value, n in updates:
        ctrl.update(current_kl=kl_value, n_steps=n)
        coefs.append(float(ctrl.value))
    adaptive = {"init_kl_coef": 0.2, "target_kl": 0.05, "horizon": 1000}
    controller = {**adaptive, "updates": updates, "values": coefs}
    return [{"inputs": inputs, "cases": cases, "adaptive_controller": controller}]


def rollout_is_cases() -> list[dict]:
    b, t = 6, 7
    mask = padded_mask(random_lengths(b, t), t)
    rollout = uniform(-3.0, -0.05, b, t)
    spread = torch.tensor([1.0, 1.0, 1.0, 0.2, 0.2, 0.05], dtype=DTYPE)[:, None]  # per row
    old = rounded(rollout + uniform(-1.5, 1.5, b, t) * spread)
    cases = []
    for level in ("token", "sequence"):
        for cap in (2.0, 5.0):
            weights, metrics = compute_rollout_correction_weights(
                log_ratio=old - rollout,
                response_mask=mask,
                rollout_is=level,
                rollout_is_threshold=cap,
            )
            cases.append(
                {
                    "id": f"{level}/cap={cap}",
                    "level": level,
                    "cap": cap,
                    "weights": tolist(weights),
                    "mean": metrics["rollout_is_mean"],
                }
            )
    inputs = {"old_log_probs": old, "rollout_log_probs": rollout, "response_mask": mask}
    return [{"inputs": {k: tolist(v) for k, v in inputs.items()}, "cases": cases}]


def stats_cases() -> dict:
    values = randn(5, 6)
    mask = interior_mask(5, 6)
    logits = randn(3, 4, 11, scale=2.0)
    return {
        "values": tolist(values),
        "mask": tolist(mask),
        "masked_mean": tolist(verl_F.masked_mean(values, mask)),
        "masked_mean_rows": tolist(verl_F.masked_mean(values, mask, axis=-1)),
        "masked_var": tolist(verl_F.masked_var(values, mask)),
        "masked_whiten": tolist(verl_F.masked_whiten(values, mask)),
        "masked_whiten_keep_mean": tolist(verl_F.masked_whiten(values, mask, shift_mean=False)),
        "logits": tolist(logits),
        "entropy": tolist(verl_F.entropy_from_logits(logits)),
    }


def to_json(doc: dict) -> str:
    """One line per case, so that a change to one case is a one-line diff."""
    lines = []
    for key, value in doc.items():
        if isinstance(value, list):
            items = ",\n".join("  " + json.dumps(item, separators=(",", ":")) for item in value)
            lines.append(f"{json.dumps(key)}: [\n{items}\n]")
        else:
            lines.append(f"{json.dumps(key)}: {json.dumps(value, separators=(',', ':'))}")
    return "{\n" + ",\n".join(lines) + "\n}\n"


def main(out_path: str) -> None:
    torch.use_deterministic_algorithms(True)
    doc = {
        "what": "inputs and outputs of verl's algorithm core on seeded float64 inputs",
        "made_by": "scripts/verl_golden/make_golden.py",
        "command": COMMAND,
        "reference": f"verl {verl.__version__} (verl.trainer.ppo.core_algos, "
        "verl.trainer.ppo.rollout_corr_helper, verl.utils.torch_functional)",
        "versions": {"verl": verl.__version__, "torch": torch.__version__, "numpy": np.__version__},
        "seed": SEED,
        "dtype": "float64",
        "advantages": advantage_cases(),
        "agg_loss": agg_loss_cases(),
        "policy_loss": policy_loss_cases(),
        "value_loss": value_loss_cases(),
        "kl": kl_cases(),
        "rollout_is": rollout_is_cases(),
        "stats": stats_cases(),
    }
    Path(out_path).write_text(to_json(doc))
    grouped = ("agg_loss", "policy_loss", "value_loss", "kl", "rollout_is")
    n = len(doc["advantages"]) + sum(len(g["cases"]) for k in grouped for g in doc[k])
    print(f"wrote {n} cases from verl {verl.__version__} to {out_path}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "tests/data/verl_golden.json")
