"""How a GRPO step's time grows with batch size and response length.

    .venv/bin/python -m benchmarks.bench_step_scaling --size 10m --engine hf

Full RL steps (``mmrl.trainer.fit.rl_step``) of mmrl's default settings on a random Qwen2
(the sizes of benchmarks/bench_vs_trl.py), over a grid of prompts per step (x 8 samples)
and response lengths. Every response is exactly ``length`` tokens (the sampler may not
stop earlier), so the work is rows x length. Each point is the median of ``--steps``
steps after a warm-up step. The log-log slopes are least-squares fits of
log(step time) on log(rows) and log(length) together; 1.0 is linear.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import tempfile
from contextlib import closing
from pathlib import Path

import numpy as np

from benchmarks.bench_vs_trl import SIZES, build_model
from benchmarks.results import write_results
from mmrl.algos import build_kl_controller
from mmrl.config import load_config
from mmrl.hybrid import build_workers
from mmrl.tasks import get_task
from mmrl.trainer.fit import PromptLoader, rl_step
from mmrl.utils.seed import set_seed
from mmrl.verifiers import VerifierRunner


def step_times(model_dir: Path, out: str, prompts: int, length: int, engine: str, steps: int):
    cfg = load_config(
        [
            f"actor_rollout_ref.model.path={model_dir}",
            f"actor_rollout_ref.rollout.name={engine}",
            f"trainer.output_dir={out}",
            f"data.train_batch_size={prompts}",
            f"actor_rollout_ref.actor.ppo_mini_batch_size={prompts}",
            f"data.max_response_length={length}",
            "actor_rollout_ref.actor.use_kl_loss=false",
            "actor_rollout_ref.rollout.n=8",
        ]
    )
    set_seed(0)
    task = get_task("text_addition")(cfg.task)
    processor = task.build_prompt_processor(model_dir, cfg)
    # Every response runs to `length` tokens, so the work is exactly rows x length.
    processor.sampling_overrides = lambda: {"min_tokens": length}
    data = processor.encode_dataset(task.build_data(0).train, "train")
    loader = PromptLoader(data, prompts, shuffle=True, seed=0)
    kl_ctrl = build_kl_controller(cfg.algorithm.kl_ctrl)
    runner = VerifierRunner.from_config(cfg.reward)
    workers = build_workers(cfg, model_dir, need_ref=False, need_critic=False)
    times = []
    with workers, closing(runner):
        for step in range(1, steps + 2):
            metrics = rl_step(
                cfg, step, loader.next(), workers.actor, None, processor, kl_ctrl, runner
            )
            times.append(metrics["timing_s/step"])
            assert metrics["response_length/min"] == length, metrics["response_length/min"]
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="10m")
    parser.add_argument("--engine", choices=("hf", "vllm"), default="hf")
    parser.add_argument("--prompts", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--lengths", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument(
        "--name", default=None, help="results file name (default: step_scaling_<size>_<engine>)"
    )
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        params = build_model(Path(tmp) / "model", *SIZES[args.size])
        for prompts, length in itertools.product(args.prompts, args.lengths):
            step = step_times(
                Path(tmp) / "model", f"{tmp}/run", prompts, length, args.engine, args.steps
            )
            rows.append(
                {
                    "rows": prompts * 8,
                    "length": length,
                    "step_s": step,
                    "load_avg_1min": os.getloadavg()[0],
                }
            )
            print(f"{prompts * 8} rows x {length} tokens: {step:.2f} s", flush=True)
    x = np.array([[1.0, np.log(r["rows"]), np.log(r["length"])] for r in rows])
    y = np.log([r["step_s"] for r in rows])
    _, slope_rows, slope_length = np.linalg.lstsq(x, y, rcond=None)[0]
    print(
        f"\n{params / 1e6:.1f}M, {args.engine}: step time (s) by rows (down) and response "
        "length (across)\n"
    )
    print("| rows \\ length | " + " | ".join(str(n) for n in args.lengths) + " |")
    print("|---" * (len(args.lengths) + 1) + "|")
    for prompts in args.prompts:
        cells = [r["step_s"] for r in rows if r["rows"] == prompts * 8]
        print(f"| {prompts * 8} | " + " | ".join(f"{c:.2f}" for c in cells) + " |")
    print(f"\nlog-log slope: rows {slope_rows:.2f}, length {slope_length:.2f}")
    write_results(
        args.name or f"step_scaling_{args.size}_{args.engine}",
        rows,
        "python -m benchmarks.bench_step_scaling " + " ".join(sys.argv[1:]),
        params=params,
        slope_rows=slope_rows,
        slope_length=slope_length,
    )


if __name__ == "__main__":
    main()
