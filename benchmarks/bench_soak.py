"""Soak: long runs must not grow. Resident memory, open files and threads of the whole run
(this process and every descendant: Ray's processes, FSDP workers, verifier workers) are
logged every step as ``system/*``; after the first 20% of steps they must stay flat, and
no process of the run may outlive it.

    .venv/bin/python -m benchmarks.bench_soak                       # the four runs below
    .venv/bin/python -m benchmarks.bench_soak --runs text-ray --scale 0.1

Runs: a 300-step text GRPO run and a 100-step token world-model GRPO run, each in this
process and with 2 Ray workers plus process-mode verifiers. Batches are small (4 prompts
x 4 samples): a leak grows per step, not per sample, and small steps give many of them.
Bounds after the warm-up (first 20% of steps): summed memory grows < 50 MiB (median of the
last 5 steps minus median of the 5 steps after warm-up), and the highest fd and thread
counts of the last 5 steps are at most those of the 5 steps after warm-up. The memory
bound is on private memory (RSS less shared pages): a Ray worker's RSS also counts the
pages of the shared object store it has read, which grow towards the store's size
without anything leaking. Summed RSS is reported beside it.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from mmrl.config import load_config
from mmrl.trainer.fit import fit
from mmrl.utils.resources import descendants

SMALL = [
    "data.train_batch_size=4",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=16",
    "trainer.progress_bar=false",
    "trainer.loggers=[jsonl]",
    "trainer.max_invalid_rate=null",
]
RAY = ["trainer.n_workers_per_node=2", "reward.num_workers=2"]
TEXT = ["task.sft.steps=50", "trainer.val_before_train=false"]
WM = [
    "task=worldmodel_tokens",
    "+task.pretrain.tokenizer.train.steps=40",
    "task.pretrain.train.steps=40",
    "task.pretrain.train.val_every=20",
    "+task.pretrain.data.train_trajectories=32",
    "+task.pretrain.data.val_trajectories=8",
    "task.val_windows=8",
    "task.eval.windows=8",
    "task.eval.samples=1",
    "task.report=false",
    "trainer.val_before_train=false",
]
WM_PROCESS_VERIFIERS = (
    "reward.verifiers=[{name: mae, weight: -1.0, mode: process},"
    " {name: psnr, weight: 0.0, mode: process}, {name: state_match, weight: 0.0}]"
)
RUNS = {
    "text-inprocess": (300, TEXT),
    "text-ray": (
        300,
        [*TEXT, *RAY, "reward.verifiers=[{name: exact_answer, weight: 1.0, mode: process}]"],
    ),
    "wm-inprocess": (100, WM),
    "wm-ray": (100, [*WM, *RAY, WM_PROCESS_VERIFIERS]),
}
RSS_GROWTH_MIB = 50.0
WINDOW = 5


@dataclass
class SoakResult:
    name: str
    steps: int
    wall_time_s: float
    rss_start_mib: float  # median of the WINDOW steps after warm-up
    rss_end_mib: float  # median of the last WINDOW steps
    rss_growth_mib: float
    private_start_mib: float  # the same for RSS less shared pages: what the bound is on
    private_end_mib: float
    private_growth_mib: float
    fds_start: float  # highest count in the WINDOW steps after warm-up
    fds_end: float  # highest count in the last WINDOW steps
    threads_start: float
    threads_end: float
    processes_peak: float
    leftover_processes: list[str]

    def problems(self, rss_bound_mib: float = RSS_GROWTH_MIB) -> list[str]:
        out = []
        if self.private_growth_mib >= rss_bound_mib:
            out.append(
                f"private memory grew {self.private_growth_mib:.1f} MiB (bound {rss_bound_mib:.1f})"
            )
        if self.fds_end > self.fds_start:
            out.append(f"open fds grew {self.fds_start:.0f} -> {self.fds_end:.0f}")
        if self.threads_end > self.threads_start:
            out.append(f"threads grew {self.threads_start:.0f} -> {self.threads_end:.0f}")
        if self.leftover_processes:
            out.append(f"processes left behind: {self.leftover_processes}")
        return out


def measure(
    name: str, history: list[dict], wall_time_s: float, leftover: list[str], warmup: float = 0.2
) -> SoakResult:
    """Bounds over the per-step ``system/*`` metrics of a run's history, after the first
    ``warmup`` fraction of its steps."""
    rows = [r for r in history if r.get("system/rss_mib") is not None]
    warm = math.ceil(warmup * len(rows))
    first, last = rows[warm : warm + WINDOW], rows[-WINDOW:]

    def col(part: list[dict], key: str) -> np.ndarray:
        return np.array([r[f"system/{key}"] for r in part], dtype=float)

    rss_start, rss_end = (
        float(np.median(col(first, "rss_mib"))),
        float(np.median(col(last, "rss_mib"))),
    )
    private_start, private_end = (
        float(np.median(col(first, "private_mib"))),
        float(np.median(col(last, "private_mib"))),
    )
    return SoakResult(
        name=name,
        steps=len(rows),
        wall_time_s=wall_time_s,
        rss_start_mib=rss_start,
        rss_end_mib=rss_end,
        rss_growth_mib=rss_end - rss_start,
        private_start_mib=private_start,
        private_end_mib=private_end,
        private_growth_mib=private_end - private_start,
        fds_start=float(col(first, "num_fds").max()),
        fds_end=float(col(last, "num_fds").max()),
        threads_start=float(col(first, "num_threads").max()),
        threads_end=float(col(last, "num_threads").max()),
        processes_peak=float(col(rows, "num_processes").max()),
        leftover_processes=leftover,
    )


def leftover_processes(before: set[int] = frozenset(), grace_s: float = 15.0) -> list[str]:
    """Descendants still alive ``grace_s`` after the run (Ray and pools stop asynchronously),
    other than the pids in ``before`` (those that existed before the run started)."""
    deadline = time.monotonic() + grace_s
    while True:
        alive = [p for p in descendants() if p.pid not in before]
        if not alive or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    names = []
    for proc in alive:
        try:
            names.append(f"{proc.pid}:{' '.join(proc.cmdline())[:80]}")
        except Exception:  # noqa: BLE001 - it ended while being named
            continue
    return names


def soak(name: str, steps: int, overrides: list[str], output_dir: Path) -> SoakResult:
    cfg = load_config(
        [*SMALL, *overrides, f"trainer.total_steps={steps}", f"trainer.output_dir={output_dir}",
         f"trainer.test_freq={max(steps // 4, 1)}"]
        + ([f"task.cache_dir={output_dir.parent / 'wm_cache'}"] if "wm" in name else [])
    )  # fmt: skip
    start = time.perf_counter()
    result = fit(cfg)
    return measure(name, result.history, time.perf_counter() - start, leftover_processes())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    parser.add_argument("--scale", type=float, default=1.0, help="fraction of the steps to run")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.runs:
            steps, overrides = RUNS[name]
            steps = max(int(steps * args.scale), 10)
            res = soak(name, steps, overrides, Path(tmp) / name)
            results.append(res)
            print(json.dumps(asdict(res)), flush=True)
    print(
        "\n| run | steps | wall s | private MiB after warm-up -> end | growth | RSS growth "
        "| fds | threads | peak processes | left behind |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r.name} | {r.steps} | {r.wall_time_s:.0f} | {r.private_start_mib:.0f} -> "
            f"{r.private_end_mib:.0f} | {r.private_growth_mib:+.1f} | {r.rss_growth_mib:+.1f} | "
            f"{r.fds_start:.0f} -> "
            f"{r.fds_end:.0f} | {r.threads_start:.0f} -> {r.threads_end:.0f} | "
            f"{r.processes_peak:.0f} | {len(r.leftover_processes)} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in results], indent=2))
    failed = {r.name: r.problems() for r in results if r.problems()}
    if failed:
        raise SystemExit(f"soak bounds broken: {failed}")


if __name__ == "__main__":
    main()
