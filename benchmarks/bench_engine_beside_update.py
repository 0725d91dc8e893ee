"""Does a vLLM engine in the trainer's process slow the training step?

    .venv/bin/python -m benchmarks.bench_engine_beside_update --size 10m

The hybrid engine keeps the vLLM engine in the same process as the actor, so the two share
its thread pool and memory. This times one forward and backward pass of the random Qwen2 of
benchmarks/bench_vs_trl.py (64 rows x 40 tokens, bf16 autocast, median of ``--iters``)
three ways in one process: before any engine exists, right after building one for the same
model, and after each of ``--rounds`` batches of 64 completions sampled with it. Equal
times mean the engine costs the update nothing; a difference above the machine's own
process-to-process noise would show here first.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

import mmrl.rollout.vllm  # noqa: F401  (sets the environment vLLM reads at import)
from benchmarks.bench_vs_trl import SIZES, build_model
from benchmarks.results import write_results

ROWS, TOKENS, NEW_TOKENS = 64, 40, 32


def forward_backward_s(model: torch.nn.Module, vocab: int, iters: int) -> float:
    """Median seconds of one bf16-autocast forward and backward of ROWS x TOKENS ids."""
    ids = torch.randint(3, vocab, (ROWS, TOKENS), generator=torch.Generator().manual_seed(0))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=ids).logits
        logits.float().mean().backward()
        times.append(time.perf_counter() - start)
    model.zero_grad(set_to_none=True)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="10m")
    parser.add_argument("--iters", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    import vllm
    from vllm.inputs import TokensPrompt

    with tempfile.TemporaryDirectory() as tmp:
        build_model(Path(tmp), *SIZES[args.size])
        model = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32)
        vocab = model.config.vocab_size
        rows = [{"when": "no engine", "fb_s": forward_backward_s(model, vocab, args.iters)}]
        llm = vllm.LLM(
            tmp,
            dtype="bfloat16",
            max_model_len=64,
            kv_cache_memory_bytes=2**28,
            enforce_eager=True,
            seed=0,
        )
        rows.append({"when": "engine built", "fb_s": forward_backward_s(model, vocab, args.iters)})
        params = vllm.SamplingParams(max_tokens=NEW_TOKENS, temperature=1.0)
        prompt = TokensPrompt(prompt_token_ids=[5, 6, 7, 8, 9])
        for round_ in range(args.rounds):
            start = time.perf_counter()
            llm.generate([prompt] * ROWS, params, use_tqdm=False)
            gen_s = time.perf_counter() - start
            fb_s = forward_backward_s(model, vocab, args.iters)
            rows.append({"when": f"after sampling {round_ + 1}", "fb_s": fb_s, "gen_s": gen_s})
    print("| when | forward + backward (s) | sampling 64 completions (s) |")
    print("|---|---|---|")
    for row in rows:
        gen = f"{row['gen_s']:.3f}" if "gen_s" in row else "–"
        print(f"| {row['when']} | {row['fb_s']:.3f} | {gen} |")
    write_results(
        f"engine_beside_update_{args.size}",
        rows,
        f"python -m benchmarks.bench_engine_beside_update --size {args.size}",
    )


if __name__ == "__main__":
    main()
