"""Rollout throughput: vLLM against transformers ``generate``, side by side, plus weight sync.

    .venv/bin/python benchmarks/bench_rollout.py [--threads 1]

Random Qwen2 models built from configs (~1M, ~20M, ~100M parameters), fixed
prompt and response lengths (``min_tokens`` = ``max_tokens``: every response has
the same length), batch sizes 16 and 64. Each configuration is timed
``--repeats`` times after one warm-up call, and the engines take turns within
each repeat, so that load from other processes hits all of them alike. Reports
the median generated tokens/s and the ratio to transformers; then, per vLLM
engine, the time of an in-place weight sync and the gap between its rollout
log-probs and the fp32 training forward's on the same tokens.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

from mmrl.config import RolloutConfig
from mmrl.hybrid.actor import compute_log_probs
from mmrl.models import get_family
from mmrl.protocol import Batch
from mmrl.rollout.module import ModuleRollout
from mmrl.sampling import SamplingParams
from mmrl.tasks.text_addition import build_char_tokenizer

# name -> (hidden, layers, heads (head_dim 64), intermediate, vocab)
SIZES = {
    "1M": (128, 2, 2, 512, 2048),
    "20M": (384, 6, 6, 1536, 8192),
    "100M": (768, 10, 12, 3072, 8192),
}
HF = "transformers fp32"
# engine label -> RolloutConfig overrides
VLLM_ENGINES = {
    "vLLM fp32": {"dtype": "float32"},
    "vLLM bf16": {"dtype": "bfloat16"},
    "vLLM bf16 compiled": {"dtype": "bfloat16", "enforce_eager": False},
}


def build_model(size: str, path: Path) -> Qwen2ForCausalLM:
    """A random fp32 Qwen2, saved to ``path`` with a tokenizer (vLLM loads both from disk)."""
    hidden, layers, heads, intermediate, vocab = SIZES[size]
    tokenizer = build_char_tokenizer()  # prompts are random ids; vLLM only needs one on disk
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        intermediate_size=intermediate,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).eval()
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return model


def random_prompts(batch_size: int, prompt_len: int, vocab: int) -> Batch:
    """Unpadded random prompts: ``input_ids``, ``attention_mask``, ``position_ids`` [B, P]."""
    gen = torch.Generator().manual_seed(batch_size)
    input_ids = torch.randint(3, vocab, (batch_size, prompt_len), generator=gen)
    mask = torch.ones_like(input_ids)
    return Batch.from_dict(
        {"input_ids": input_ids, "attention_mask": mask, "position_ids": mask.cumsum(-1) - 1}
    )


def throughput(
    engines: dict, prompts: Batch, sampling: SamplingParams, repeats: int
) -> dict[str, float]:
    """Median generated tokens/s per engine; engines alternate within each repeat."""
    warm_up = dataclasses.replace(sampling, max_tokens=2, min_tokens=2)
    for engine in engines.values():  # lazy initialisation and compiles for these shapes
        engine.generate(prompts, warm_up)
    speeds: dict[str, list[float]] = {label: [] for label in engines}
    for _ in range(repeats):
        for label, engine in engines.items():
            start = time.perf_counter()
            out = engine.generate(prompts, sampling)
            speeds[label].append(out["responses"].numel() / (time.perf_counter() - start))
            assert int(out["response_mask"].sum()) == out["responses"].numel(), (
                "responses must be full length"
            )
    return {label: statistics.median(values) for label, values in speeds.items()}


def sync_time_s(engine, model: torch.nn.Module, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        engine.sync_weights(model)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def logprob_gap(
    engine, model: torch.nn.Module, prompts: Batch, sampling: SamplingParams
) -> tuple[float, float]:
    """Mean and max |rollout log-prob - fp32 training log-prob| over the sampled tokens.

    Sampled without ``min_tokens``: that mask removes EOS from the sampling distribution,
    which the training forward does not do.
    """
    out = engine.generate(prompts, dataclasses.replace(sampling, min_tokens=0))
    recomputed = compute_log_probs(get_family("text_lm"), model, out, 16, sampling.temperature)
    gap = (out["rollout_log_probs"] - recomputed).abs()[out["response_mask"].bool()]
    return float(gap.mean()), float(gap.max())


def bench_size(size: str, args, rows: list[dict], engine_rows: list[dict]) -> None:
    from mmrl.rollout.vllm import VLLMRollout

    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(size, Path(tmp))
        tokenizer = AutoTokenizer.from_pretrained(tmp)
        params = sum(p.numel() for p in model.parameters())
        engines = {HF: ModuleRollout(model, get_family("text_lm"), tokenizer)}
        for label in args.engines:
            cfg = RolloutConfig(name="vllm", kv_cache_memory_gib=0.5, **VLLM_ENGINES[label])
            start = time.perf_counter()
            engines[label] = VLLMRollout(
                model,
                get_family("text_lm"),
                tokenizer,
                tmp,
                cfg,
                args.prompt_len + args.response_len,
            )
            engine_rows.append(dict(size=size, engine=label, startup_s=time.perf_counter() - start))
        n = args.response_len
        sampling = SamplingParams(max_tokens=n, min_tokens=n, temperature=1.0, seed=0)
        for batch_size in args.batch_sizes:
            prompts = random_prompts(batch_size, args.prompt_len, SIZES[size][-1])
            speeds = throughput(engines, prompts, sampling, args.repeats)
            for label, tps in speeds.items():
                rows.append(
                    dict(
                        size=size,
                        params=params,
                        batch=batch_size,
                        engine=label,
                        tps=tps,
                        ratio=tps / speeds[HF],
                    )
                )
                print(
                    f"{size} B={batch_size} {label}: {tps:.0f} tok/s ({tps / speeds[HF]:.2f}x)",
                    flush=True,
                )
        prompts = random_prompts(args.batch_sizes[0], args.prompt_len, SIZES[size][-1])
        for row in engine_rows[-len(args.engines) :]:
            engine = engines[row["engine"]]
            rollout_s = (
                args.batch_sizes[-1]
                * n
                / next(r["tps"] for r in reversed(rows) if r["engine"] == row["engine"])
            )
            row.update(sync_s=sync_time_s(engine, model, args.repeats), rollout_s=rollout_s)
            row["gap_mean"], row["gap_max"] = logprob_gap(engine, model, prompts, sampling)
        del engines, model
        gc.collect()


def print_tables(args, rows: list[dict], engine_rows: list[dict]) -> None:
    labels = [HF, *args.engines]
    print("| model | batch | " + " | ".join(f"{label} (tok/s)" for label in labels) + " |")
    print("|---|---|" + "---|" * len(labels))
    for size in args.sizes:
        for batch_size in args.batch_sizes:
            cells = {r["engine"]: r for r in rows if r["size"] == size and r["batch"] == batch_size}
            text = [f"{cells[HF]['tps']:.0f}"] + [
                f"{cells[x]['tps']:.0f} ({cells[x]['ratio']:.2f}x)" for x in args.engines
            ]
            print(
                f"| {size} ({cells[HF]['params'] / 1e6:.1f}M) | {batch_size} | "
                + " | ".join(text)
                + " |"
            )
    print(
        "\n| model | engine | start-up (s) | weight sync (s) | sync / rollout at "
        f"B={args.batch_sizes[-1]} "
        "| rollout vs fp32 training log-prob, mean / max abs diff |"
    )
    print("|---|---|---|---|---|---|")
    for r in engine_rows:
        print(
            f"| {r['size']} | {r['engine']} | {r['startup_s']:.1f} | {r['sync_s']:.3f} | "
            f"{r['sync_s'] / r['rollout_s']:.1%} | {r['gap_mean']:.1e} / {r['gap_max']:.1e} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument(
        "--engines", nargs="+", default=list(VLLM_ENGINES), choices=list(VLLM_ENGINES)
    )
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--response-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--threads", type=int, default=torch.get_num_threads(), help="torch threads, all engines"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    start, load_start = time.perf_counter(), os.getloadavg()[0]
    rows, engine_rows = [], []
    for size in args.sizes:
        bench_size(size, args, rows, engine_rows)
    print(
        f"\nprompt {args.prompt_len} tokens, {args.response_len} sampled tokens, temperature 1; "
        f"{args.threads} torch thread(s); median of {args.repeats}; 1-min load average "
        f"{load_start:.1f} at start, {os.getloadavg()[0]:.1f} at end; total "
        f"{time.perf_counter() - start:.0f} s\n"
    )
    print_tables(args, rows, engine_rows)


if __name__ == "__main__":
    main()
