"""Multi-seed proof that GRPO raises test accuracy of a tiny VLM on a procedural visual task.

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.bench_vlm_grpo --seeds 0 1 2
    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.bench_vlm_grpo --task visual_counting
    trainer.total_steps=40

Each seed runs ``mmrl train task=<task>`` as its config file sets it (a tiny Qwen2-VL built
from config, the fixed SFT warm-up budget ``task.sft``, then GRPO), plus any trailing Hydra
overrides. Test accuracy is the task's first verifier (``choice_answer`` for
``visual_comparison``, ``math_answer`` for ``visual_counting``) on 256 test images that
nothing else reads (``task.test_size``), for the warm-up model and the RL actor: 4 samples
per image at temperature 1 with the same seeds for both, and greedy. The format rate
comes from validation.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import numpy as np

from benchmarks.results import mean_std, write_results
from benchmarks.split_eval import test_split_accuracy
from mmrl.config import load_config
from mmrl.trainer.fit import fit


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--task", default="visual_comparison")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("overrides", nargs="*", help="Hydra overrides after task=<task>")
    args = parser.parse_args()
    rows = []
    for seed in args.seeds:
        with tempfile.TemporaryDirectory() as out:
            cfg = load_config(
                [
                    f"task={args.task}",
                    f"trainer.seed={seed}",
                    f"trainer.output_dir={out}",
                    "trainer.progress_bar=false",
                    "trainer.loggers=[jsonl]",
                    "task.test_size=256",
                    *args.overrides,
                ]
            )
            verifier = cfg.reward.verifiers[0].name
            result = fit(cfg)
            test = test_split_accuracy(cfg)
        acc = [test["before"], test["after"]]
        greedy = [test["greedy_before"], test["greedy_after"]]
        fmt = result.series("val/format/mean") or [float("nan")] * 2
        sft_loss = result.history[0].get("sft/final_loss", float("nan"))
        rows.append(
            (
                seed,
                acc[0],
                acc[-1],
                greedy[0],
                greedy[-1],
                fmt[0],
                fmt[-1],
                sft_loss,
                result.wall_time_s,
                result.peak_memory_gib,
            )
        )
        print(
            f"seed {seed}: test accuracy {acc[0]:.3f} -> {acc[-1]:.3f} sampled, "
            f"greedy {greedy[0]:.3f} -> {greedy[1]:.3f}; {result.wall_time_s:.0f} s, "
            f"load average {os.getloadavg()[0]:.1f}",
            flush=True,
        )
    table = np.array([r[1:] for r in rows])
    print(f"\n{args.task}: {verifier} on test images")
    print(
        "| seed | accuracy before RL (after SFT) | after RL | greedy before | greedy after | "
        "format before (val) | "
        "format after (val) | SFT final loss | wall time (s) | peak memory (GiB) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for seed, *values in rows:
        print(
            f"| {seed} | "
            + " | ".join(f"{v:.3f}" for v in values[:7])
            + f" | {values[7]:.0f} | {values[8]:.2f} |"
        )
    print("| mean ± std (ddof=1) | " + " | ".join(mean_std(c) for c in table.T[:6]) + " | | | |")
    keys = ("before", "after", "greedy_before", "greedy_after", "format_before", "format_after")
    keys += ("sft_final_loss", "wall_time_s", "peak_memory_gib")
    write_results(
        f"vlm_grpo_{args.task}",
        [{"seed": seed, **dict(zip(keys, values, strict=True))} for seed, *values in rows],
        "python -m benchmarks.bench_vlm_grpo " + " ".join(sys.argv[1:]),
    )
    rise = table[:, 1] - table[:, 0]
    print(f"\nimprovement: {rise.mean():+.3f} (rose on {int(np.sum(rise > 0))}/{len(rows)} seeds)")


if __name__ == "__main__":
    main()
