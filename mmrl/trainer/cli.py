"""The ``mmrl`` command line: ``mmrl train [hydra overrides...]``, ``mmrl pretrain-worldmodel
...``, ``mmrl eval ...`` (any checkpoint: world models on trajectories, VLMs on parquet),
``mmrl report RUN_DIR`` (the run's HTML report) and ``mmrl doctor RUN_DIR`` (what is wrong).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from mmrl.config import RunConfig, load_config
from mmrl.errors import MMRLError
from mmrl.trainer.doctor import STAGES, diagnose
from mmrl.trainer.report import doctor_config, load_run, write_report

DEBUG_ENV = "MMRL_DEBUG"


def train(overrides: list[str], config_name: str = "train", dry_run: bool = False) -> int:
    from mmrl.trainer.preflight import preflight

    # Every problem at once: the field checks run with the preflight's (registries, verifiers,
    # task keys, paths, context length, engine limits), before the SFT warm-up, pretraining,
    # data generation or a Ray start.
    cfg = load_config(overrides, config_name, validate=False)
    if dry_run:
        return dry_run_report(cfg, f"config {config_name!r} with {len(overrides)} override(s)")
    preflight(cfg)
    from mmrl.trainer.fit import fit

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


def dry_run_report(cfg: RunConfig, what: str = "config") -> int:
    """Print the resolved config and every problem found, training nothing; 0 when there is
    none."""
    from omegaconf import OmegaConf

    from mmrl.trainer.preflight import find_problems

    print(OmegaConf.to_yaml(OmegaConf.structured(cfg)), end="")
    problems = find_problems(cfg)
    if not problems:
        print(f"# {what} is valid: no problems found")
        return 0
    print(f"# {len(problems)} problem(s) found:", file=sys.stderr)
    for problem in problems:
        print(f"  - {problem}", file=sys.stderr)
    return 1


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


def report(run_dir: str) -> int:
    """Rebuild ``<run_dir>/report.html`` from what the run folder holds."""
    print(f"report: {write_report(run_dir)}")
    return 0


def doctor(run_dir: str, overrides: list[str]) -> int:
    """Print the doctor's findings in data-flow order; 0 when there is none, else 1."""
    record = load_run(run_dir)
    findings = diagnose(record.history, doctor_config(record, overrides), record.worldmodel_eval)
    steps = sum(1 for row in record.history if row.get("step", 0) >= 1)
    status = "finished" if record.summary else "did not finish"
    print(f"mmrl doctor: {record.run_dir} ({steps} RL steps logged, {status})")
    print(f"checks in data-flow order: {', '.join(STAGES)}")
    if not findings:
        print("no problem found")
        return 0
    for i, finding in enumerate(findings, 1):
        print(f"{i}. {finding.line()}")
    return 1


def main(argv: list[str] | None = None) -> int:
    """Run one command. An expected error (:class:`~mmrl.errors.MMRLError`) prints in one or two
    lines and returns 1; with ``--debug`` or ``MMRL_DEBUG=1`` it raises with its traceback. Any
    other exception is a bug and always keeps its traceback."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv or os.environ.get(DEBUG_ENV, "") not in ("", "0")
    argv = [a for a in argv if a != "--debug"]
    try:
        return run(argv)
    except MMRLError as err:
        if debug:
            raise
        print(f"mmrl: error: {err.short()}", file=sys.stderr)
        return 1


def run(argv: list[str]) -> int:
    """Dispatch ``argv`` to its command; errors propagate (see :func:`main`)."""
    if argv[:1] == ["eval"]:  # its own argparse options (mmrl eval --help)
        rest = argv[1:]
        if any(
            a == "--parquet" or a.startswith("--parquet=") for a in rest
        ):  # a VLM on parquet: eval-vlm
            logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
            return evaluate_vlm(rest)
        logging.basicConfig(level=logging.WARNING)
        return evaluate(rest)
    # Taken out before parsing, so that they may come before, between or after the overrides.
    dry_run = argv[:1] == ["train"] and "--dry-run" in argv
    argv = [a for a in argv if not (dry_run and a == "--dry-run")]
    parser = argparse.ArgumentParser(prog="mmrl", description="RLVR for multimodal models.")
    parser.add_argument(
        "--debug", action="store_true", help=f"show tracebacks of expected errors ({DEBUG_ENV}=1)"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p_train = sub.add_parser("train", help="RL training; trailing arguments are Hydra overrides")
    p_train.add_argument("overrides", nargs="*", help="e.g. algorithm.adv_estimator=rloo")
    p_train.add_argument(
        "--dry-run",
        action="store_true",
        help="print the resolved config and every problem found, then exit",
    )
    p_train.add_argument(
        "--config-name",
        default="train",
        help="a config under mmrl/configs/, e.g. examples/worldmodel_tokens_gpu",
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
    p_report = sub.add_parser(
        "report", help="(re)write RUN_DIR/report.html, one self-contained page about the run"
    )
    p_report.add_argument("run_dir", help="a run's trainer.output_dir (also a crashed run)")
    p_doctor = sub.add_parser(
        "doctor", help="what is likely wrong with a run, in data-flow order (exit 1 if anything)"
    )
    p_doctor.add_argument("run_dir", help="a run's trainer.output_dir")
    p_doctor.add_argument(
        "overrides", nargs="*", help="thresholds, e.g. trainer.doctor.kl_spike_factor=5"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.command == "train":
        return train(args.overrides, args.config_name, dry_run)
    if args.command == "pretrain-worldmodel":
        return pretrain_worldmodel(args.overrides)
    if args.command == "report":
        return report(args.run_dir)
    if args.command == "doctor":
        return doctor(args.run_dir, args.overrides)
    return 2


if __name__ == "__main__":
    sys.exit(main())
