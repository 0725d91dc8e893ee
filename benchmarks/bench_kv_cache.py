"""Decoding with transformers' ``DynamicCache`` against mmrl's in-place ``GrowingCache``.

    .venv/bin/python -m benchmarks.bench_kv_cache

Greedy decoding, one token per step with a key/value cache, of random Qwen2 models at the
shapes mmrl samples: the default token world model (hidden 128, 4 layers) on 136-token
prompts with one frame (64 tokens) or four frames and three actions (259 tokens) per
response, and the 10.6M text model of benchmarks/bench_vs_trl.py on 8-token prompts with
32 to 256 new tokens. Both caches give the same tokens and logits (tests/test_kv_cache.py).
The two take turns ``--repeats`` times after a warm-up; the table gives median seconds.
``mmrl.models.kv_cache.LONG_SEQUENCE`` is where the in-place cache starts to pay.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from transformers import DynamicCache, Qwen2Config, Qwen2ForCausalLM

from benchmarks.results import write_results
from mmrl.models.kv_cache import GrowingCache

MODELS = {  # hidden, layers, heads, vocabulary
    "world model 0.7M": (128, 4, 2, 200),
    "text 10.6M": (384, 6, 6, 100),
}
SHAPES = [  # model, rows, prompt tokens, new tokens
    ("world model 0.7M", 64, 136, 64),
    ("world model 0.7M", 64, 136, 259),
    ("world model 0.7M", 32, 136, 259),
    ("text 10.6M", 64, 8, 32),
    ("text 10.6M", 64, 8, 128),
    ("text 10.6M", 64, 8, 256),
]


def build(name: str, dtype: torch.dtype) -> Qwen2ForCausalLM:
    hidden, layers, heads, vocab = MODELS[name]
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=512,
    )
    return Qwen2ForCausalLM(config).to(dtype).eval()


@torch.no_grad()
def decode(model: Qwen2ForCausalLM, cache: DynamicCache, prompts: torch.Tensor, steps: int):
    ids = prompts
    for _ in range(steps):
        logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits
        ids = logits[:, -1].argmax(-1, keepdim=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"]
    )
    args = parser.parse_args()
    rows = []
    for dtype in args.dtypes:
        for name, batch, prompt_len, steps in SHAPES:
            model = build(name, getattr(torch, dtype))
            layers = model.config.num_hidden_layers
            prompts = torch.randint(0, model.config.vocab_size, (batch, prompt_len))
            caches = {  # a fresh cache per run
                "DynamicCache": lambda m=model: DynamicCache(config=m.config),
                "GrowingCache": lambda n=layers, c=prompt_len + steps: GrowingCache(n, c),
            }
            times: dict[str, list[float]] = {c: [] for c in caches}
            for repeat in range(args.repeats + 1):  # the first round warms up
                for cache_name, make in caches.items():
                    start = time.perf_counter()
                    decode(model, make(), prompts, steps)
                    if repeat:
                        times[cache_name].append(time.perf_counter() - start)
            med = {c: statistics.median(t) for c, t in times.items()}
            row = {
                "model": name,
                "dtype": dtype,
                "rows": batch,
                "prompt_tokens": prompt_len,
                "new_tokens": steps,
                **{f"{c}_s": m for c, m in med.items()},
                "speedup": med["DynamicCache"] / med["GrowingCache"],
                "times_s": times,
            }
            rows.append(row)
            print(
                f"| {name} | {dtype} | {batch} | {prompt_len} | {steps} | "
                f"{med['DynamicCache']:.3f} | {med['GrowingCache']:.3f} | {row['speedup']:.2f}x |",
                flush=True,
            )
    write_results("kv_cache", rows, "python -m benchmarks.bench_kv_cache " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
