"""``mmrl eval --model DIR --data DIR``: held-out metrics of a world-model checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

from mmrl.errors import ConfigError
from mmrl.tasks.worldmodel_eval import (
    check_source_fits,
    check_trajectory_length,
    evaluate_model,
    format_steps,
    format_table,
    load_checkpoint,
    open_trajectories,
    reference_rows,
)
from mmrl.tasks.worldmodel_eval_latent import (
    LATENT_FAMILIES,
    check_source_fits_latent,
    evaluate_latent,
    latent_reference_rows,
    load_latent_policy,
)


def main(argv: list[str] | None = None) -> int:
    """``mmrl eval --model DIR --data DIR``: metrics of a world-model checkpoint (token world
    model, or a Gaussian or flow-matching latent policy folder) on trajectory data."""
    import argparse

    from mmrl.models import policy_family
    from mmrl.processors.worldmodel import load_windows

    p = argparse.ArgumentParser(prog="mmrl eval", description=main.__doc__)
    p.add_argument(
        "--model",
        required=True,
        help="world-model checkpoint (token_wm/best, an RL actor/ folder) "
        "or a latent policy folder (latent_policy.json or flow_policy.json + autoencoder/)",
    )
    p.add_argument(
        "--data", required=True, help="trajectory dataset folder, or a folder of .mp4 + actions"
    )
    p.add_argument("--tokenizer", help="VQ tokenizer folder (default: <model>/vq_tokenizer)")
    p.add_argument(
        "--future",
        type=int,
        help="frames a latent policy predicts per window (default 2; a token model has its own)",
    )
    p.add_argument(
        "--windows", type=int, default=64, help="windows drawn from the data (all if fewer)"
    )
    p.add_argument("--samples", type=int, default=4, help="sampled predictions per window")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument(
        "--num-actions", type=int, help="mp4 sidecars hold discrete action ids in [0, N)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--tau",
        type=float,
        default=0.01,
        help="repetition threshold: mean |pixel change| in [0, 1] below which a frame stands still",
    )
    p.add_argument(
        "--horizon",
        type=int,
        default=0,
        help="also roll the token model out on its own predictions for this many frames "
        "(e.g. 12) and report the error per step",
    )
    p.add_argument("--json", help="also write the metrics here")
    args = p.parse_args(argv)
    sampled = f"model (sampled x{args.samples}, T={args.temperature:g})"
    if not Path(args.model).is_dir():  # before the family check, whose message is about training
        raise FileNotFoundError(f"world-model checkpoint {args.model} does not exist")
    if policy_family(args.model).name in LATENT_FAMILIES:  # a token world model is a text LM
        policy, ae, family = load_latent_policy(args.model)
        context, future = policy.cfg.context, args.future or 2
        source = open_trajectories(args.data, args.num_actions)
        check_source_fits_latent(source, policy, ae, args.data)
        check_trajectory_length(source, context, future, args.data)
        windows = load_windows(source, context, future, args.windows, args.seed)
        common = {"seed": args.seed, "family": family, "tau": args.tau}
        greedy = evaluate_latent(policy, ae, windows, True, **common)
        sampled_run = evaluate_latent(
            policy, ae, windows, False, args.samples, temperature=args.temperature, **common
        )
        rows = {"model (greedy)": greedy.metrics, sampled: sampled_run.metrics}
        rows.update(latent_reference_rows(windows, ae, future, args.tau))
        kind = {"latent": "latent policy", "flow_latent": "flow-matching latent policy"}[family]
    else:
        model, processor, tokenizer = load_checkpoint(args.model, args.tokenizer)
        context, future = processor.context, processor.future
        if args.future is not None and args.future != future:
            raise ConfigError(
                f"--future {args.future}: the token world model {args.model} predicts {future} "
                "frames"
            )
        source = open_trajectories(args.data, args.num_actions)
        check_source_fits(source, processor, tokenizer, args.data)
        check_trajectory_length(source, context, future, args.data)
        if args.horizon:  # before the evaluation, not after it
            from mmrl.tasks.worldmodel_rollout import check_rollout_length

            check_rollout_length(source, context, args.horizon)
        windows = load_windows(source, context, future, args.windows, args.seed)
        rows = {
            "model (greedy)": evaluate_model(
                model, processor, tokenizer, windows, True, seed=args.seed, tau=args.tau
            ).metrics,
            sampled: evaluate_model(
                model,
                processor,
                tokenizer,
                windows,
                False,
                args.samples,
                args.seed,
                args.temperature,
                args.tau,
            ).metrics,
        }
        rows.update(reference_rows(windows, tokenizer, future))
        kind = "token world model"
    env = windows.env["name"] if windows.env else "unknown (no state match)"
    print(
        f"\n{kind}; {len(windows)} windows of {args.data} (env: {env}); {context} context frames, "
        f"{future} predicted\n"
    )
    print(format_table(rows))
    print(f"\nper future step (t = 1..{future}; slope: change per step)\n")
    print(format_steps(rows, future))
    if args.horizon and kind == "token world model":
        from mmrl.tasks.worldmodel_rollout import evaluate_rollout

        rollout = evaluate_rollout(
            model, processor, tokenizer, source, args.horizon, args.windows, args.seed, args.tau
        )
        print(f"\nautoregressive rollout of {args.horizon} frames on its own predictions\n")
        print(format_steps(rollout, args.horizon))
        rows.update({f"rollout: {k}": v for k, v in rollout.items()})
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0
