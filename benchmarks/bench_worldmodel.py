"""Token world-model GRPO over several seeds: held-out base vs RL, greedy and sampled.

    OMP_NUM_THREADS=1 python -m benchmarks.bench_worldmodel --seeds 0 1 2 --out outputs/bench_wm
    [overrides...]

Each seed is one `mmrl train task=worldmodel_tokens trainer.seed=<s>` run. The
pretrained start is the task's cached MLE pretraining (one run, shared by the seeds
unless an override changes it, e.g. ``task.pretrain.seed=<s>`` via ``--pretrain-per-seed``).
The test windows come from trajectories that neither pretraining, its checkpoint choice,
validation nor tuning read, and the base and the RL model are decoded the same way
(greedy; and sampled at the same temperature). Copying the last context frame and the
tokenizer's ceiling are scored on the same windows. Prints a Markdown table of mean ± std
over seeds and writes it, with the per-seed numbers, to ``<out>/bench_worldmodel.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.results import mean_std, write_results

METRICS = (
    ("psnr", "PSNR dB ↑", 2),
    ("ssim", "SSIM ↑", 4),
    ("lpips", "LPIPS ↓", 4),
    ("state_match", "state match ↑", 3),
)


def run_seed(
    seed: int, out: Path, overrides: list[str], pretrain_per_seed: bool, task: str
) -> dict:
    from mmrl.config import load_config
    from mmrl.trainer.fit import fit

    extra = [f"task.pretrain.seed={seed}"] if pretrain_per_seed else []
    cfg = load_config(
        [
            f"task={task}",
            f"trainer.seed={seed}",
            f"trainer.output_dir={out / f'seed{seed}'}",
            "trainer.progress_bar=false",
            *extra,
            *overrides,
        ]
    )
    done = Path(cfg.trainer.output_dir) / "summary.json"
    if done.exists():  # a rerun keeps the seeds that finished
        summary = json.loads(done.read_text())
    else:
        result = fit(cfg)
        summary = {**result.summary, "wall_time_s": result.wall_time_s,
                   "peak_memory_gib": result.peak_memory_gib}  # fmt: skip
    rows, future = references(cfg, task)
    return {
        "table": summary["worldmodel_eval"],
        "references": rows,
        "future": future,
        "wall_time_s": summary["wall_time_s"],
        "peak_memory_gib": summary["peak_memory_gib"],
    }


def references(cfg, task_name: str) -> tuple[dict[str, dict[str, float]], int]:
    """Copy-last-frame and tokenizer-ceiling rows on the run's test windows, and its F."""
    from mmrl.tasks import get_task
    from mmrl.tasks.worldmodel_eval import TOKENIZER_SUBDIR, reference_rows
    from mmrl.worldmodel.tokenizer import VQTokenizer

    task = get_task(task_name)(cfg.task)
    windows = task.build_data(cfg.trainer.seed).test
    tokenizer = VQTokenizer.from_pretrained(cfg.output_dir / "actor" / TOKENIZER_SUBDIR)
    future = task.pretrain_cfg.data.future
    return reference_rows(windows, tokenizer, future), future


def markdown(runs: dict[int, dict]) -> str:
    def cell(values: list[float], digits: int) -> str:
        return mean_std(values, digits)

    head = "| model | decoding | " + " | ".join(name for _, name, _ in METRICS) + " |"
    lines = [head, "|---|---|" + "---|" * len(METRICS)]
    for name, row in next(iter(runs.values()))["references"].items():
        lines.append(
            f"| {name} | – | " + " | ".join(f"{row[k]:.{d}f}" for k, _, d in METRICS) + " |"
        )
    for decoding in ("greedy", "sampled"):
        for model in ("base", "rl"):
            vals = [
                cell([r["table"][model][decoding][k] for r in runs.values()], d)
                for k, _, d in METRICS
            ]
            label = "pretrained (MLE)" if model == "base" else "+ GRPO"
            lines.append(f"| {label} | {decoding} | " + " | ".join(vals) + " |")
        deltas = [
            cell(
                [
                    r["table"]["rl"][decoding][k] - r["table"]["base"][decoding][k]
                    for r in runs.values()
                ],
                d,
            )
            for k, _, d in METRICS
        ]
        lines.append(f"| Δ (RL − base) | {decoding} | " + " | ".join(deltas) + " |")
    return "\n".join(lines)


def per_step_markdown(runs: dict[int, dict], future: int) -> str:
    """PSNR and LPIPS at each future step t = 1..F: references, then base and RL (mean ± std)."""
    keys = [f"{m}@t{t}" for m in ("psnr", "lpips") for t in range(1, future + 1)]
    digits = {k: 2 if k.startswith("psnr") else 4 for k in keys}
    lines = ["| model | decoding | " + " | ".join(keys) + " |", "|---|---|" + "---|" * len(keys)]
    for name, row in next(iter(runs.values()))["references"].items():
        cells = " | ".join(f"{row[k]:.{digits[k]}f}" for k in keys)
        lines.append(f"| {name} | – | {cells} |")
    for decoding in ("greedy", "sampled"):
        for model in ("base", "rl"):
            vals = [mean_std([r["table"][model][decoding][k] for r in runs.values()], digits[k])
                    for k in keys]  # fmt: skip
            label = "pretrained (MLE)" if model == "base" else "+ GRPO"
            lines.append(f"| {label} | {decoding} | " + " | ".join(vals) + " |")
    return "\n".join(lines)


def beats_copy(runs: dict[int, dict], future: int) -> list[str]:
    """Per model, decoding and metric (overall and per future step): does the mean over seeds
    beat copying the last frame by more than 2 sample standard deviations?"""
    copy = next(iter(runs.values()))["references"]["copy last context frame"]
    steps = [f"{m}@t{t}" for m in ("psnr", "lpips") for t in range(1, future + 1)]
    keys = ["psnr", "lpips"] + (steps if future > 1 else [])
    out = []
    for model in ("base", "rl"):
        for decoding in ("greedy", "sampled"):
            verdicts = []
            for k in keys:
                values = np.array([r["table"][model][decoding][k] for r in runs.values()])
                sign = -1.0 if k.startswith("lpips") else 1.0
                margin = sign * (values.mean() - copy[k])
                spread = values.std(ddof=1) if len(values) > 1 else 0.0
                verdicts.append(f"{k} {'yes' if margin > 2 * spread else 'NO'} "
                                f"({margin:+.4g}, 2s={2 * spread:.2g})")  # fmt: skip
            out.append(f"{model} {decoding} beats copy-last: " + "; ".join(verdicts))
    return out


def split_seeds(tokens: list[str]) -> tuple[list[int], list[str]]:
    """The seeds and the Hydra overrides among what ``--seeds`` took: with ``nargs="+"`` it
    also takes the overrides that follow it (``--seeds 0 1 key=value``)."""
    seeds = [t for t in tokens if "=" not in t]
    if not seeds or not all(t.isdigit() for t in seeds):
        raise ValueError(f"--seeds takes integers, got {' '.join(seeds) or 'none'}")
    return [int(t) for t in seeds], [t for t in tokens if "=" in t]


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--seeds", nargs="+", default=["0", "1", "2"])
    p.add_argument("--task", default="worldmodel_tokens", help="or worldmodel_videos")
    p.add_argument("--name", default="worldmodel_tokens", help="benchmarks/results/<name>.json")
    p.add_argument("--out", type=Path, default=Path("outputs/bench_wm"))
    p.add_argument(
        "--pretrain-per-seed", action="store_true", help="also pretrain one base per seed"
    )
    p.add_argument("overrides", nargs="*", help="Hydra overrides for every run")
    args = p.parse_args()
    try:
        args.seeds, overrides = split_seeds(args.seeds)
    except ValueError as err:
        p.error(str(err))
    args.overrides += overrides
    start = time.perf_counter()
    runs = {
        s: run_seed(s, args.out, args.overrides, args.pretrain_per_seed, args.task)
        for s in args.seeds
    }
    future = runs[args.seeds[0]]["future"]
    table = "\n\n".join(
        [markdown(runs), per_step_markdown(runs, future), "\n".join(beats_copy(runs, future))]
    )
    load = os.getloadavg()[1]
    note = (
        f"{len(runs)} seeds {args.seeds}; total {time.perf_counter() - start:.0f} s, "
        f"5-min load average at the end {load:.2f}; overrides: {args.overrides or 'none'}"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_worldmodel.md").write_text(table + "\n\n" + note + "\n")
    (args.out / "bench_worldmodel.json").write_text(
        json.dumps({"runs": runs, "note": note}, indent=1)
    )
    write_results(
        args.name,
        {str(seed): run for seed, run in runs.items()},
        "python -m benchmarks.bench_worldmodel " + " ".join(sys.argv[1:]),
        note=note,
    )
    print(table)
    print(note)


if __name__ == "__main__":
    main()
