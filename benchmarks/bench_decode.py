"""The transformers engine's sampling loop: ``decode_rows`` against transformers ``generate``.

    .venv/bin/python -m benchmarks.bench_decode --sizes 10m 85m

The random Qwen2 models of benchmarks/bench_vs_trl.py (with mmrl's character tokenizer)
sample 64 responses to its addition prompts (8 prompts x 8), in bf16 (the dtype the actor
computes in under ``trainer.mixed_precision=auto`` on a CPU with bf16 instructions) and in
fp32. Each row stops at a length drawn as a GRPO batch of a young policy has them:
geometric with mean 15, capped at 32 (a processor puts the stop token there), so one long
row keeps ``generate`` computing the whole batch while ``decode_rows`` computes only the
rows still going. Both sample the same tokens (tests/test_decode_rows.py). The loops take
turns ``--repeats`` times after a warm-up; the table gives the median seconds per batch.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer, LogitsProcessorList

from benchmarks.bench_vs_trl import SIZES, addition_data, build_model
from benchmarks.results import write_results
from mmrl.models import get_family
from mmrl.models.decode import decode_rows
from mmrl.models.text_lm import transformers_generate

ROWS, MAX_TOKENS, MEAN_LENGTH = 64, 32, 15


class StopAtLength:
    """Row r may not stop before step ``lengths[r] - 1`` and must stop there."""

    def __init__(self, lengths: torch.Tensor, prompt_len: int, stop_id: int) -> None:
        self.lengths, self.prompt_len, self.stop_id = lengths, prompt_len, stop_id

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        step = input_ids.shape[1] - self.prompt_len
        scores = scores.clone()
        scores[:, self.stop_id] = float("-inf")
        rows = self.lengths - 1 == step
        scores[rows] = float("-inf")
        scores[rows, self.stop_id] = 0.0
        return scores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["10m", "85m"], choices=sorted(SIZES))
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    lengths = (torch.empty(ROWS).exponential_(1 / MEAN_LENGTH, generator=gen).long() + 1).clamp(
        max=MAX_TOKENS
    )
    prompts, _ = addition_data(0)
    rows = []
    for size in args.sizes:
        with tempfile.TemporaryDirectory() as tmp:
            params = build_model(Path(tmp), *SIZES[size])
            base = get_family("text_lm").load(Path(tmp))
            tokenizer = AutoTokenizer.from_pretrained(tmp)
        tokenizer.padding_side = "left"
        texts = [p for p in prompts[:8] for _ in range(8)]
        enc = tokenizer(texts, return_tensors="pt", padding=True)
        stop = StopAtLength(lengths, enc.input_ids.shape[1], tokenizer.eos_token_id)
        call = (enc.input_ids, enc.attention_mask, LogitsProcessorList([stop]), MAX_TOKENS)
        for dtype in args.dtypes:
            model = base.to(getattr(torch, dtype)).eval()
            loops = {"generate": transformers_generate, "decode_rows": decode_rows}
            times: dict[str, list[float]] = {name: [] for name in loops}
            with torch.no_grad():
                for repeat in range(args.repeats + 1):  # the first round warms up
                    for name, loop in loops.items():
                        start = time.perf_counter()
                        loop(model, *call, {tokenizer.eos_token_id}, tokenizer.pad_token_id)
                        if repeat:
                            times[name].append(time.perf_counter() - start)
            medians = {name: statistics.median(t) for name, t in times.items()}
            rows.append(
                {
                    "size": size,
                    "params": params,
                    "dtype": dtype,
                    **{f"{name}_s": m for name, m in medians.items()},
                    "speedup": medians["generate"] / medians["decode_rows"],
                    "times_s": times,
                }
            )
            print(
                f"{size} {dtype}: generate {medians['generate']:.3f} s, decode_rows "
                f"{medians['decode_rows']:.3f} s, {rows[-1]['speedup']:.2f}x",
                flush=True,
            )
    print(
        f"\n{ROWS} rows, lengths mean {lengths.float().mean():.1f} (max {int(lengths.max())}), "
        f"{torch.get_num_threads()} threads\n| model | dtype | generate (s) | decode_rows (s) | "
        "speed-up |\n|---|---|---|---|---|"
    )
    for r in rows:
        print(
            f"| {r['size']} | {r['dtype']} | {r['generate_s']:.3f} | {r['decode_rows_s']:.3f} "
            f"| {r['speedup']:.2f}x |"
        )
    write_results(
        "decode_rows", rows, "python -m benchmarks.bench_decode " + " ".join(sys.argv[1:])
    )


if __name__ == "__main__":
    main()
