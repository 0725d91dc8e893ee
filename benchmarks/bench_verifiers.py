"""Verifier throughput and runner overhead.

    .venv/bin/python benchmarks/bench_verifiers.py

1. Frames per second of PSNR, SSIM and LPIPS (alex, vgg) on batches of 64x64 and
   128x128 frames (``--frames`` per call, uint8 [B, F, H, W, 3], on ``--device``).
2. Overhead of :class:`VerifierRunner` over calling the verifier directly, for a
   batch of 256 samples and a verifier that takes ~10 ms per call, in batch mode
   (the default) and in process mode (one worker call of 256 samples).
   Bare and runner calls alternate; overhead is the median paired difference over
   ``--overhead-repeats`` pairs, in wall time (over the median bare call) and, for
   batch mode, as the CPU time the runner spends outside the verifier (over the
   verifier's own CPU time), which the machine's other load inflates less.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import textwrap
import time
from pathlib import Path

import torch

from mmrl.protocol import Batch
from mmrl.verifiers import VerifierRunner, get_verifier

BUSY_VERIFIER = '''
import time

def busy_10ms(batch):
    """Spins for 10 ms of CPU time, then scores every sample 1.0 (a stand-in for a ~10 ms check)."""
    end = time.thread_time() + 0.010
    while time.thread_time() < end:
        pass
    return [1.0] * len(batch)


def noop(batch):
    return [1.0] * len(batch)
'''


def frame_batch(n_frames: int, size: int, device: str) -> Batch:
    b, f = n_frames // 4, 4
    gen = torch.Generator().manual_seed(0)
    gt = torch.randint(0, 256, (b, f, size, size, 3), dtype=torch.uint8, generator=gen)
    noise = torch.randint(-20, 21, gt.shape, generator=gen)
    pred = (gt.int() + noise).clamp(0, 255).to(torch.uint8)
    return Batch.from_dict({"pred_frames": pred, "gt_frames": gt}).to(device)


def median_s(fn, repeats: int) -> float:
    fn()  # warm-up: imports, weight loading, allocator
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_frames(n_frames: int, repeats: int, device: str) -> list[tuple[str, int, float]]:
    rows = []
    for size in (64, 128):
        batch = frame_batch(n_frames, size, device)
        for name, kwargs in (
            ("psnr", {}),
            ("ssim", {}),
            ("lpips", {"net": "alex"}),
            ("lpips", {"net": "vgg"}),
        ):
            fn = get_verifier(name)
            seconds = median_s(
                lambda fn=fn, kwargs=kwargs, batch=batch: fn(batch, **kwargs), repeats
            )
            label = f"{name} ({kwargs['net']})" if kwargs else name
            rows.append((label, size, n_frames / seconds))
            print(
                f"{label:14s} {size:4d}x{size:<4d} {n_frames / seconds:10.1f} frames/s", flush=True
            )
    return rows


def text_batch(n: int) -> Batch:
    return Batch.from_dict(
        {"responses": torch.zeros(n, 64, dtype=torch.long), "response_mask": torch.ones(n, 64)},
        {
            "uid": [f"1-{i}" for i in range(n)],
            "response_text": ["<answer>1</answer>"] * n,
            "ground_truth": ["1"] * n,
        },
    )


def _timed(fn) -> tuple[float, float]:
    """(wall seconds, this thread's CPU seconds) of one call."""
    wall, cpu = time.perf_counter(), time.thread_time()
    fn()
    return time.perf_counter() - wall, time.thread_time() - cpu


def _cpu_recorder(fn, record: list[float]):
    def wrapped(batch: Batch) -> list[float]:
        start = time.thread_time()
        out = fn(batch)
        record.append(time.thread_time() - start)
        return out

    return wrapped


def bench_overhead(repeats: int) -> list[tuple[str, float, float, float, float | None]]:
    """Rows ``(mode, bare ms, runner ms, wall overhead %, CPU overhead % or None)``."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "busy.py"
        path.write_text(textwrap.dedent(BUSY_VERIFIER))
        ref = f"{path}:busy_10ms"
        batch, bare = text_batch(256), get_verifier(ref)
        for mode in ("batch", "process"):
            spec = {"name": ref, "weight": 1.0, "mode": mode, "chunk_size": 256, "timeout_s": 30.0}
            with VerifierRunner([spec], num_workers=1) as runner:
                inner_cpu: list[float] = []
                if mode == "batch":  # record the verifier's own CPU time inside the runner
                    runner.verifiers[0].fn = _cpu_recorder(bare, inner_cpu)
                runner.run(batch)  # warm-up (starts the worker in process mode)
                inner_cpu.clear()
                pairs = [
                    (_timed(lambda: bare(batch)), _timed(lambda: runner.run(batch)))
                    for _ in range(repeats)
                ]
            bare_wall = statistics.median(b[0] for b, _ in pairs)
            runner_wall = statistics.median(r[0] for _, r in pairs)
            # Paired differences: a neighbour's load spike tends to hit both calls of a pair.
            wall_pct = 100 * statistics.median(r[0] - b[0] for b, r in pairs) / bare_wall
            # Batch mode: this thread's CPU time in run() minus the verifier's own, i.e. the
            # runner's work, which other processes on the machine do not inflate.
            cpu_pct = None
            if mode == "batch":
                outside = statistics.median(
                    r[1] - inner for (_, r), inner in zip(pairs, inner_cpu, strict=True)
                )
                cpu_pct = 100 * outside / statistics.median(inner_cpu)
            rows.append((mode, bare_wall * 1e3, runner_wall * 1e3, wall_pct, cpu_pct))
            cpu = f"  CPU {cpu_pct:+.2f}%" if cpu_pct is not None else ""
            print(
                f"runner {mode:8s} bare {bare_wall * 1e3:7.2f} ms  runner {runner_wall * 1e3:7.2f} "
                f"ms  wall {wall_pct:+.2f}%{cpu}",
                flush=True,
            )
        # The runner's own cost per call, independent of the verifier: a no-op, back to back.
        fn = get_verifier(f"{path}:noop")
        with VerifierRunner([(f"{path}:noop", 1.0)]) as runner:
            fixed_s = median_s(lambda: runner.run(batch), 500) - median_s(lambda: fn(batch), 500)
        rows.append(
            (
                "batch: the runner alone (no-op verifier), as a share of 10 ms",
                0.0,
                fixed_s * 1e3,
                100 * fixed_s / 0.010,
                None,
            )
        )
        print(
            f"runner fixed cost {fixed_s * 1e3:.3f} ms per call = {100 * fixed_s / 0.010:.2f}% of "
            "10 ms",
            flush=True,
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--frames", type=int, default=64, help="frames per verifier call")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--overhead-repeats", type=int, default=200)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--only", choices=["frames", "overhead"], default=None, help="run one part")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, device {args.device}")
    frames = bench_frames(args.frames, args.repeats, args.device) if args.only != "overhead" else []
    overhead = bench_overhead(args.overhead_repeats) if args.only != "frames" else []
    print("\n| metric | 64x64 frames/s | 128x128 frames/s |\n|---|---|---|")
    for label in dict.fromkeys(r[0] for r in frames):
        per_size = {size: fps for name, size, fps in frames if name == label}
        print(f"| {label} | {per_size[64]:.0f} | {per_size[128]:.0f} |")
    print(
        "\n| runner mode | bare call | through the runner | overhead (wall) | runner CPU outside "
        "the verifier |"
    )
    print("|---|---|---|---|---|")
    for mode, b, r, wall_pct, cpu_pct in overhead:
        cpu = f"{cpu_pct:+.2f}%" if cpu_pct is not None else "n/a"
        bare_ms = f"{b:.2f} ms" if b else "-"
        print(f"| {mode} | {bare_ms} | {r:.3f} ms | {wall_pct:+.2f}% | {cpu} |")


if __name__ == "__main__":
    main()
