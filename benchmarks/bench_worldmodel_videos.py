"""Your own videos, small: RL seeds on one pretrained start, test-split base vs RL.

    OMP_NUM_THREADS=1 python -m benchmarks.bench_worldmodel_videos --seeds 0 1 2 \
        --out outputs/bench_wm_videos

The recipe of the slow test (tests/test_worldmodel_videos_e2e.py, settings in
tests/video_data.py): 24 mp4 episodes written with PyAV (48x64, 3-dim continuous
actions), ``mmrl pretrain-worldmodel`` once, then ``mmrl train task=worldmodel_videos``
per RL seed, all through the CLI. Base and RL are scored on the test split (episodes
that neither pretraining, checkpoint selection nor RL saw). Writes the per-seed numbers,
the mean and the sample standard deviation of each to ``--json``
(default benchmarks/results/worldmodel_videos.json) and prints a Markdown table; the
slow test's LPIPS margin is set against the spread measured here.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from benchmarks.results import machine
from tests.video_data import EPISODES, FRAMES, PRETRAIN, SHAPE, train_args, write_episodes

KEYS = ("psnr", "lpips", "ssim", "repetition")


def main() -> int:
    from mmrl.trainer.cli import main as mmrl

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--out", type=Path, default=Path("outputs/bench_wm_videos"))
    p.add_argument("--json", type=Path, default=Path("benchmarks/results/worldmodel_videos.json"))
    p.add_argument(
        "--rl",
        default="",
        help="space-separated overrides added to every RL run's `mmrl train` (a recipe variant)",
    )
    args = p.parse_args()
    videos = args.out / "videos"
    if not videos.exists():
        write_episodes(videos, EPISODES, t=FRAMES, shape=SHAPE)
    pre = args.out / "pretrain"
    start = time.perf_counter()
    if not (pre / "pretrain_summary.json").exists():  # a rerun keeps its pretrained start
        mmrl(["pretrain-worldmodel", f"data.videos={videos}", f"output_dir={pre}",
              "progress_bar=false", *PRETRAIN])  # fmt: skip
    pretrain_s = time.perf_counter() - start
    runs = {}
    for seed in args.seeds:
        variant = "".join(c if c.isalnum() or c in ".-" else "_" for c in args.rl)
        run = args.out / (f"seed{seed}-{variant}" if variant else f"seed{seed}")
        start = time.perf_counter()
        assert mmrl([*train_args(videos, pre, run, seed), *args.rl.split()]) == 0
        table = json.loads((run / "worldmodel_eval.json").read_text())
        lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        steps = [m["timing_s/step"] for m in lines if "timing_s/step" in m]
        runs[seed] = {
            "table": table,
            "wall_time_s": time.perf_counter() - start,
            "grpo_step_time_s": float(np.median(steps)) if steps else None,
        }
    summary = {}
    for decoding in ("greedy", "sampled"):
        for model in ("base", "rl"):
            for key in KEYS:
                values = [runs[s]["table"][model][decoding].get(key, np.nan) for s in args.seeds]
                summary[f"{model}/{decoding}/{key}"] = _stats(values)
        for key in KEYS:
            diffs = [
                runs[s]["table"]["rl"][decoding][key] - runs[s]["table"]["base"][decoding][key]
                for s in args.seeds
            ]
            summary[f"rl-base/{decoding}/{key}"] = _stats(diffs)
    result = {
        "command": "OMP_NUM_THREADS=1 python -m benchmarks.bench_worldmodel_videos "
        f"--seeds {' '.join(map(str, args.seeds))}" + (f" --rl '{args.rl}'" if args.rl else ""),
        "machine": machine(),
        "pretrain_wall_time_s": pretrain_s,
        "summary": summary,
        "runs": {str(s): r for s, r in runs.items()},
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1))
    print("| test split (greedy) | base | RL | RL - base |")
    print("|---|---|---|---|")
    for key in KEYS:
        b, r, d = (summary[f"{m}/greedy/{key}"] for m in ("base", "rl", "rl-base"))
        print(f"| {key} | {_cell(b)} | {_cell(r)} | {_cell(d)} |")
    return 0


def _stats(values: list[float]) -> dict[str, float]:
    arr = np.asarray(values, dtype=float)
    std = float(arr.std(ddof=1)) if len(arr) > 1 else float("nan")
    return {"mean": float(arr.mean()), "std": std, "values": arr.tolist()}


def _cell(s: dict[str, float]) -> str:
    return f"{s['mean']:.4f} ± {s['std']:.4f}"


if __name__ == "__main__":
    raise SystemExit(main())
