"""bf16 against fp32 for one actor update, across model sizes: where ``auto``'s bf16 pays.

    .venv/bin/python -m benchmarks.bench_precision --repeats 5

For each size, a random Qwen2 (head size 64 where the width allows, MLP 8/3 x hidden, the
character tokenizer of benchmarks/bench_vs_trl.py) takes one PPO update
(``mmrl.hybrid.actor.update_policy``) of the GRPO-shaped batch of
benchmarks/bench_actor_update.py under the one-rank FSDP2 wrapper the worker uses, once with
``trainer.mixed_precision=fp32`` and once with ``bf16`` (fp32 master weights), in
alternation, ``--repeats`` times after a warm-up; the table gives the medians and their
ratio. It also prints what ``auto`` picks on this CPU (``mmrl.hybrid.fsdp.cpu_has_bf16``).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.bench_actor_update import ROWS, TEXT_LM, grpo_like_batch
from benchmarks.bench_vs_trl import build_model
from benchmarks.results import write_results
from mmrl.config import ActorConfig
from mmrl.hybrid import fsdp
from mmrl.hybrid.actor import update_policy

# (hidden, layers): 0.1M to 10.6M parameters; the last is bench_vs_trl's 10m.
WIDTHS = [(64, 2), (128, 2), (192, 4), (256, 4), (384, 6)]
PRECISIONS = ("fp32", "bf16")


def update_times(hidden: int, layers: int, repeats: int) -> tuple[int, dict[str, list[float]]]:
    """Parameters, and seconds per update for each precision (warm-up dropped)."""
    with tempfile.TemporaryDirectory() as tmp:
        params = build_model(Path(tmp), hidden, layers)
        base = TEXT_LM.load(Path(tmp))
    batch = grpo_like_batch(base.config.vocab_size)
    actor = dataclasses.replace(ActorConfig(), use_kl_loss=False, lr=1e-5)
    models = {}
    for precision in PRECISIONS:
        model = fsdp.shard_model(copy.deepcopy(base), fsdp.mixed_precision_policy(precision, "cpu"))
        models[precision] = (model, torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True))
    times: dict[str, list[float]] = {p: [] for p in PRECISIONS}
    for _ in range(repeats + 1):
        for precision, (model, optimizer) in models.items():
            start = time.perf_counter()
            update_policy(
                TEXT_LM,
                model,
                optimizer,
                batch.clone(),
                actor,
                mini_batch_size=ROWS,
                temperature=1.0,
                seed=0,
            )
            times[precision].append(time.perf_counter() - start)
    return params, {p: t[1:] for p, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    fsdp.init_process_group(0, 1, "cpu", timeout_s=600)
    print(
        f"this CPU has bf16 instructions: {fsdp.cpu_has_bf16()}; trainer.mixed_precision=auto "
        f"picks {fsdp.resolve_precision('auto', 'cpu')}; {torch.get_num_threads()} threads"
    )
    print("| parameters | hidden x layers | fp32 update (s) | bf16 update (s) | bf16 speed-up |")
    print("|---|---|---|---|---|")
    rows = []
    for hidden, layers in WIDTHS:
        params, times = update_times(hidden, layers, args.repeats)
        fp32, bf16 = (statistics.median(times[p]) for p in PRECISIONS)
        rows.append({"params": params, "hidden": hidden, "layers": layers, "times_s": times})
        print(
            f"| {params / 1e6:.2f}M | {hidden} x {layers} | {fp32:.3f} | {bf16:.3f} | "
            f"{fp32 / bf16:.2f}x |",
            flush=True,
        )
    write_results(
        "precision_by_size",
        rows,
        "python -m benchmarks.bench_precision " + " ".join(sys.argv[1:]),
        cpu_has_bf16=fsdp.cpu_has_bf16(),
    )


if __name__ == "__main__":
    main()
