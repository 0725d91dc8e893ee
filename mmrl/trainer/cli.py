"""The ``mmrl`` command line: ``mmrl train [hydra overrides...]``, ``mmrl pretrain-worldmodel
...``, ``mmrl eval ...`` (any checkpoint: world models on trajectories, VLMs on parquet).
"""

from __future__ import annotations

import argparse
import logging
import sys

from mmrl.config import load_config


def dry_run(overrides: list[str], config_name: str = "train") -> int:
    """Compose and validate the run's config and its task's settings; print it, train nothing."""
    from dataclasses import asdict

    from omegaconf import OmegaConf

    from mmrl.tasks import get_task

    cfg = load_config(overrides, config_name)
    get_task(cfg.task.get("name", ""))(cfg.task)  # the task checks its own keys
    print(OmegaConf.to_yaml(OmegaConf.create(asdict(cfg))), end="")
    print(f"# config {config_name!r} with {len(overrides)} override(s) is valid")
    return 0


def train(overrides: list[str], config_name: str = "train") -> int:
    from mmrl.trainer.fit import fit

    cfg = load_config(overrides, config_name)
    result = fit(cfg)
    val = result.series("val/score/mean")
    print(f"\nrun finished: {result.output_dir}")
    if val:
        print(
            f"  held-out score: {val[0]:.3f} before RL -> {val[-1]:.3f} after "
            f"{cfg.trainer.total_steps} steps"
        )
    print(f"  metrics:        {result.output_dir / 'metrics.jsonl'}")
    print(f"  trained actor:  {result.output_dir / 'actor'} (save_pretrained)")
    table = result.summary.get("worldmodel_eval")
    if table:
        from mmrl.tasks.worldmodel_eval import format_table

        print("\n  held-out world-model metrics (base = pretrained start, rl = after GRPO):")
        rows = {f"{m} ({d})": table[m][d] for d in ("greedy", "sampled") for m in ("base", "rl")}
        print(
            "\n".join("  " + line for line in format_table(rows, "model (decoding)").splitlines())
        )
    if result.summary.get("report"):
        print(f"  report:         {result.summary['report']}")
    print(f"  wall time:      {result.wall_time_s:.1f} s")
    print(f"  peak memory:    {result.peak_memory_gib:.2f} GiB")
    return 0


def pretrain_worldmodel(overrides: list[str]) -> int:
    from mmrl.worldmodel.pretrain import main as pretrain_main

    return pretrain_main(overrides)


def evaluate(argv: list[str]) -> int:
    from mmrl.trainer.eval_worldmodel import main as eval_main

    return eval_main(argv)


def evaluate_vlm(argv: list[str]) -> int:
    from mmrl.trainer import eval_vlm

    parser = argparse.ArgumentParser(
        prog="mmrl eval", description="Accuracy of a VLM checkpoint on parquet files."
    )
    eval_vlm.add_arguments(parser)
    return eval_vlm.main(parser.parse_args(argv))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["eval"]:  # its own argparse options (mmrl eval --help)
        rest = argv[1:]
        if any(
            a == "--parquet" or a.startswith("--parquet=") for a in rest
        ):  # a VLM on parquet: eval-vlm
            logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
            return evaluate_vlm(rest)
        logging.basicConfig(level=logging.WARNING)
        return evaluate(rest)
    parser = argparse.ArgumentParser(prog="mmrl", description="RLVR for multimodal models.")
    sub = parser.add_subparsers(dest="command", required=True)
    p_train = sub.add_parser("train", help="RL training; trailing arguments are Hydra overrides")
    p_train.add_argument("overrides", nargs="*", help="e.g. algorithm.adv_estimator=rloo")
    p_train.add_argument(
        "--config-name",
        default="train",
        help="a config under mmrl/configs/, e.g. examples/worldmodel_tokens_gpu",
    )
    p_train.add_argument(
        "--dry-run",
        action="store_true",
        help="compose and validate the config, print it and exit without training",
    )
    p_wm = sub.add_parser(
        "pretrain-worldmodel",
        help="MLE pretraining of the token world model; trailing arguments are Hydra overrides",
    )
    p_wm.add_argument("overrides", nargs="*", help="e.g. data.env=push train.steps=1500")
    sub.add_parser(
        "eval",
        help="a world-model checkpoint on trajectory or mp4 data (--model, --data), or a "
        "VLM checkpoint on parquet files (--checkpoint, --parquet); mmrl eval --help",
    )
    if argv[:1] == ["eval-vlm"]:  # the old spelling of `mmrl eval --parquet`
        print(
            "mmrl: `mmrl eval-vlm` is now `mmrl eval --checkpoint DIR --parquet FILE ...` "
            "(same options)",
            file=sys.stderr,
        )
        return 2
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.command == "train":
        run = dry_run if args.dry_run else train
        return run(args.overrides, args.config_name)
    if args.command == "pretrain-worldmodel":
        return pretrain_worldmodel(args.overrides)
    return 2


if __name__ == "__main__":
    sys.exit(main())
