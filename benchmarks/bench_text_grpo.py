"""Multi-seed proof that GRPO raises held-out reward on the addition task.

    .venv/bin/python -m benchmarks.bench_text_grpo --seeds 0 1 2

Each seed runs the default config (SFT warm-up, then GRPO) and reports the
held-out score before RL and at the end, with the same sampling for both.
"""

from __future__ import annotations

import argparse
import sys
import tempfile

import numpy as np

from benchmarks.results import mean_std, write_results
from mmrl.config import load_config
from mmrl.trainer.fit import fit


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    rows = []
    for seed in args.seeds:
        with tempfile.TemporaryDirectory() as out:
            cfg = load_config(
                [
                    f"trainer.seed={seed}",
                    f"trainer.output_dir={out}",
                    "trainer.progress_bar=false",
                    "trainer.loggers=[jsonl]",
                    *args.overrides,
                ]
            )
            result = fit(cfg)
        val = result.series("val/score/mean")
        rows.append((seed, val[0], val[-1], result.wall_time_s, result.peak_memory_gib))
        print(
            f"seed {seed}: held-out {val[0]:.3f} -> {val[-1]:.3f} ({result.wall_time_s:.0f} s)",
            flush=True,
        )
    before, after = np.array([r[1] for r in rows]), np.array([r[2] for r in rows])
    print("\n| seed | held-out before RL | after RL | wall time (s) | peak memory (GiB) |")
    print("|---|---|---|---|---|")
    for seed, b, a, t, m in rows:
        print(f"| {seed} | {b:.3f} | {a:.3f} | {t:.0f} | {m:.2f} |")
    print(f"| mean ± std (ddof=1) | {mean_std(before)} | {mean_std(after)} | | |")
    write_results(
        "text_grpo",
        [
            {"seed": s, "before": b, "after": a, "wall_time_s": t, "peak_memory_gib": m}
            for s, b, a, t, m in rows
        ],
        "python -m benchmarks.bench_text_grpo " + " ".join(sys.argv[1:]),
    )
    print(
        f"\nimprovement: {np.mean(after - before):+.3f} (rose on "
        f"{int(np.sum(after > before))}/{len(rows)} seeds)"
    )


if __name__ == "__main__":
    main()
