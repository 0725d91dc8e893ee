"""What each actor-update switch costs: one PPO update of a GRPO batch, setting by setting.

    .venv/bin/python -m benchmarks.bench_actor_update --size 10m --repeats 3

A random Qwen2 (the sizes of benchmarks/bench_vs_trl.py) takes one optimizer step
(``mmrl.hybrid.actor.update_policy``: forward, backward, AdamW) on a batch shaped like a
GRPO step of the addition task from a random model: 64 rows, prompts of 4-6 tokens
left-padded to 16, responses of geometric length (mean about 15) right-padded to 32.
Every setting runs in this process on the same batch, in alternation, ``--repeats``
times; the table gives the median time and its ratio to the first setting. Settings:

- ``padded``: ``model.trim_padding=false`` (every row at 16 + 32 tokens);
- ``trimmed``: each micro-batch at its own longest prompt and response
  (``model.remove_padding=false``);
- ``packed``: the default, rows packed end to end without padding (``model.remove_padding``);
- ``dynamic N``: ``actor.use_dynamic_bsz=true``, ``ppo_max_token_len_per_gpu=N``
  (``--max-tokens``);
- ``fsdp``: the one-rank FSDP2 wrapper the worker uses, against the plain module;
- ``fsdp bf16`` (``--bf16``): the FSDP2 mixed-precision policy
  (``trainer.mixed_precision=bf16``);
- ``autocast bf16`` (``--bf16``): the plain module under ``torch.autocast`` (what TRL's
  ``bf16=true`` does on CPU), for comparison;
- ``fsdp bf16 dynamic N`` (``--bf16``): the mixed-precision policy with token-budget
  micro-batches (the first ``--max-tokens``);
- ``flash attention`` (``--bf16``): torch's flash attention kernel in the update
  (``actor.math_attention_max_len=0``) instead of the math kernel every other setting runs
  on these short rows.
- ``shared prompts`` (``--group K``): the default, with each group of ``K`` rows sharing its
  prompt (``model.share_prompts``); ``--prompt-tokens N`` makes every prompt ``N`` tokens
  long, as a world model's frames or a VLM's image make it.

``--only SETTING ...`` runs those settings alone (the first is the baseline of the ratios).
``--profile SETTING`` runs one more update of that setting under ``torch.profiler`` and
prints the operators that took the most time.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.bench_vs_trl import SIZES, build_model
from benchmarks.results import write_results
from mmrl.config import ActorConfig
from mmrl.hybrid import fsdp
from mmrl.hybrid.actor import update_policy
from mmrl.models import get_family
from mmrl.protocol import Batch

TEXT_LM = get_family("text_lm")
ROWS, RESPONSE = 64, 32


def grpo_like_batch(vocab: int, seed: int = 0, group: int = 1, prompt_tokens: int = 0) -> Batch:
    """Prompts of 4-6 tokens left-padded to 16 (or all ``prompt_tokens`` long), each shared
    by ``group`` consecutive rows."""
    gen = torch.Generator().manual_seed(seed)
    width = prompt_tokens or 16
    prompt_len = torch.randint(4, 7, (ROWS,), generator=gen)
    if prompt_tokens:
        prompt_len = torch.full((ROWS,), prompt_tokens)
    prompt_len = prompt_len[torch.arange(ROWS) // group * group]
    # A random model stops with probability 1/vocab-ish per step: geometric lengths, capped.
    stop = torch.empty(ROWS).exponential_(1 / 15, generator=gen).long() + 1
    response_len = stop.clamp(max=RESPONSE)
    prompt_mask = (torch.arange(width)[None] >= width - prompt_len[:, None]).long()
    response_mask = (torch.arange(RESPONSE)[None] < response_len[:, None]).float()
    attention_mask = torch.cat([prompt_mask, response_mask.long()], dim=1)
    input_ids = torch.randint(3, vocab, attention_mask.shape, generator=gen)
    input_ids[:, :width] = input_ids[torch.arange(ROWS) // group * group, :width]
    input_ids = input_ids * attention_mask
    out = Batch.from_dict(
        {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
            "responses": input_ids[:, width:],
            "response_mask": response_mask,
            "valid_mask": torch.ones(ROWS, dtype=torch.bool),
            "advantages": torch.randn(ROWS, 1, generator=gen).expand(ROWS, RESPONSE).clone(),
        }
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="10m")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, nargs="+", default=[512, 1024, 2048])
    parser.add_argument("--bf16", action="store_true", help="also the bf16 mixed-precision policy")
    parser.add_argument("--profile", help="a setting to profile once more, by operator")
    parser.add_argument("--only", nargs="+", help="these settings alone; the first is the baseline")
    parser.add_argument("--group", type=int, default=1, help="rows that share each prompt")
    parser.add_argument("--prompt-tokens", type=int, default=0, help="every prompt's length")
    args = parser.parse_args()
    fsdp.init_process_group(0, 1, "cpu", timeout_s=600)
    with tempfile.TemporaryDirectory() as tmp:
        params = build_model(Path(tmp), *SIZES[args.size])
        base = TEXT_LM.load(Path(tmp))
    batch = grpo_like_batch(base.config.vocab_size, 0, args.group, args.prompt_tokens)
    actor = dataclasses.replace(ActorConfig(), use_kl_loss=False, lr=1e-5)
    dynamic = {
        budget: dataclasses.replace(actor, use_dynamic_bsz=True, ppo_max_token_len_per_gpu=budget)
        for budget in args.max_tokens
    }
    settings = {
        "padded": (False, actor, "plain", None),
        "trimmed": (True, actor, "plain", None),
        "packed": ("pack", actor, "plain", None),
        **{f"dynamic {b}": (True, cfg, "plain", None) for b, cfg in dynamic.items()},
        "fsdp padded": (False, actor, "fsdp", None),
        "fsdp trimmed": (True, actor, "fsdp", None),
        "fsdp packed": ("pack", actor, "fsdp", None),
    }
    if args.bf16:
        settings["fsdp bf16 trimmed"] = (True, actor, "fsdp", "bf16")
        settings["autocast bf16 trimmed"] = (True, actor, "plain", "autocast")
        budget = args.max_tokens[0]
        settings[f"fsdp bf16 dynamic {budget}"] = (True, dynamic[budget], "fsdp", "bf16")
        settings["fsdp bf16 packed"] = ("pack", actor, "fsdp", "bf16")
        flash = dataclasses.replace(actor, math_attention_max_len=0)
        settings["fsdp bf16 packed, flash attention"] = ("pack", flash, "fsdp", "bf16")
    if args.group > 1:
        settings["fsdp packed, shared prompts"] = ("share", actor, "fsdp", None)
        if args.bf16:
            settings["fsdp bf16 packed, shared prompts"] = ("share", actor, "fsdp", "bf16")
    unknown = set(args.only or []) - set(settings)
    if unknown:
        parser.error(f"--only {sorted(unknown)}: expected names from {sorted(settings)}")
    if args.only:  # each setting holds its own model and AdamW state: 85M runs out of memory
        settings = {name: settings[name] for name in args.only}
    if args.profile and args.profile not in settings:
        parser.error(f"--profile {args.profile!r}: expected one of {sorted(settings)}")
    models = {}
    for name, (_, _, wrap, precision) in settings.items():
        model = copy.deepcopy(base)
        if wrap == "fsdp":
            model = fsdp.shard_model(model, fsdp.mixed_precision_policy(precision or "fp32", "cpu"))
        # Fused, as the worker's default (actor.fused_optimizer): torch's per-tensor loop costs
        # far more over FSDP2's DTensor parameters than over plain ones.
        models[name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True))

    def update(name: str) -> float:
        trim, cfg, _, precision = settings[name]
        model, optimizer = models[name]
        autocast = (
            torch.autocast("cpu", dtype=torch.bfloat16)
            if precision == "autocast"
            else contextlib.nullcontext()
        )
        start = time.perf_counter()
        with autocast:
            update_policy(
                TEXT_LM,
                model,
                optimizer,
                batch.clone(),
                cfg,
                mini_batch_size=ROWS,
                temperature=1.0,
                seed=0,
                trim=bool(trim),
                pack=trim in ("pack", "share"),
                share_prompts=trim == "share",
            )
        return time.perf_counter() - start

    times: dict[str, list[float]] = {name: [] for name in settings}
    for _ in range(args.repeats + 1):  # the first round warms up
        for name in settings:
            times[name].append(update(name))
    baseline = next(iter(settings))
    first = statistics.median(times[baseline][1:])
    real = int(batch["attention_mask"].sum())
    print(
        f"\n{params / 1e6:.1f}M parameters, {ROWS} rows, {real} real of "
        f"{batch['attention_mask'].numel()} padded tokens, {torch.get_num_threads()} threads"
    )
    print(f"| setting | update (s) | vs {baseline} |\n|---|---|---|")
    rows = []
    for name, values in times.items():
        median = statistics.median(values[1:])
        rows.append({"setting": name, "median_s": median, "times_s": values[1:]})
        print(f"| {name} | {median:.2f} | {first / median:.2f}x |")
    if args.profile:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            update(args.profile)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    write_results(
        f"actor_update_{args.size}"
        + (f"_group{args.group}_prompt{args.prompt_tokens}" if args.group > 1 else ""),
        rows,
        "python -m benchmarks.bench_actor_update " + " ".join(sys.argv[1:]),
        params=params,
    )


if __name__ == "__main__":
    main()
