"""One GRPO step of mmrl against TRL's GRPOTrainer, on the same model, data and settings.

    .venv/bin/pip install -e .[bench]       # TRL, pinned; never a runtime dependency
    .venv/bin/python -m benchmarks.bench_vs_trl --size 10m --engine hf
    .venv/bin/python -m benchmarks.bench_vs_trl --size 85m --engine vllm \
        --trl bf16=false --trl bf16=true --mmrl "" --mmrl "trainer.mixed_precision=fp32"

Both sides train the same random Qwen2 (built from config, saved once) with mmrl's
character tokenizer on addition prompts: 8 prompts x 8 samples per step, up to 32 new
tokens, temperature 1, lr 1e-5, no reference model (TRL ``beta=0``, mmrl
``use_kl_loss=false``), one optimizer step per generation batch. TRL generates with
transformers (``use_vllm=False``); mmrl with ``--engine``. Each configuration runs in its
own process (so its peak RSS is its own), one after another, ``--repeats`` times in
alternation so that a change in the machine's load hits both; the step time is the
median over ``--steps`` steps. It prints both step times, their ratio, mmrl's stage
breakdown (``timing_s/*``) and peak memory, and writes benchmarks/results/vs_trl_*.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.results import write_results
from mmrl.config import load_config
from mmrl.hybrid import fsdp
from mmrl.tasks import get_task
from mmrl.tasks.text_addition import build_char_tokenizer
from mmrl.trainer.fit import fit

SIZES = {"10m": (384, 6), "85m": (768, 12)}
STAGES = ("gen", "reward", "old_log_prob", "adv", "update_actor", "update_weights")
RESULT_TAG = "BENCH_RESULT "


def build_model(out: Path, hidden: int, layers: int) -> int:
    """A random addition-task Qwen2 (head size 64, MLP 8/3 x hidden) with mmrl's character
    tokenizer, saved to ``out``; returns its parameter count."""
    task = get_task("text_addition")(
        {
            "name": "text_addition",
            "model": {
                "hidden_size": hidden,
                "intermediate_size": hidden * 8 // 3,
                "num_hidden_layers": layers,
                "num_attention_heads": hidden // 64,
                "num_key_value_heads": hidden // 64,
            },
        }
    )
    tokenizer = build_char_tokenizer()
    model = task.build_model(tokenizer)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


def addition_data(seed: int) -> tuple[list[str], list[str]]:
    """The addition task's training prompts and answers, as mmrl's task draws them."""
    data = get_task("text_addition")({"name": "text_addition"}).build_data(seed).train
    return list(data.prompts), list(data.ground_truth)


def run_trl(model_dir: Path, steps: int, options: dict[str, str]) -> dict:
    """``steps`` GRPOTrainer steps; ``options`` are extra GRPOConfig fields (``bf16=true``)."""
    # TRL is the bench extra's, imported only on its side.
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    prompts, answers = addition_data(0)
    dataset = Dataset.from_dict({"prompt": prompts, "answer": answers})

    def exact_answer(completions: list[str], answer: list[str], **_: object) -> list[float]:
        return [float(c.strip() == a) for c, a in zip(completions, answer, strict=True)]

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_step_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter() - self.start)

    fields = {
        k: json.loads(v.lower()) if v.lower() in ("true", "false") else v
        for k, v in options.items()
    }
    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(
            output_dir=out,
            per_device_train_batch_size=64,  # completions: 8 prompts x num_generations
            gradient_accumulation_steps=1,
            num_generations=8,
            max_completion_length=32,
            temperature=1.0,
            learning_rate=1e-5,
            beta=0.0,
            max_steps=steps,
            logging_steps=1,
            report_to=[],
            save_strategy="no",
            use_cpu=True,
            seed=0,
            **{"bf16": False, **fields},
        )
        timer = StepTimer()
        trainer = GRPOTrainer(
            model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
            reward_funcs=exact_answer,
            args=args,
            train_dataset=dataset,
            processing_class=AutoTokenizer.from_pretrained(model_dir),
            callbacks=[timer],
        )
        trainer.train()
        # The completions' length decides a step's work: report it beside mmrl's.
        lengths = [
            row["completions/mean_length"]
            for row in trainer.state.log_history
            if "completions/mean_length" in row
        ]
    return {
        "step_times_s": timer.times,
        "response_length_mean": statistics.mean(lengths) if lengths else float("nan"),
    }


def run_mmrl(model_dir: Path, steps: int, engine: str, overrides: list[str]) -> dict:
    """``steps`` GRPO steps of ``mmrl train`` with the same settings, plus ``overrides``."""
    with tempfile.TemporaryDirectory() as out:
        cfg = load_config(
            [
                f"actor_rollout_ref.model.path={model_dir}",
                f"actor_rollout_ref.rollout.name={engine}",
                "actor_rollout_ref.rollout.n=8",
                "actor_rollout_ref.actor.lr=1e-5",
                "actor_rollout_ref.actor.use_kl_loss=false",
                "actor_rollout_ref.actor.ppo_mini_batch_size=8",
                "data.train_batch_size=8",
                "data.max_response_length=32",
                f"trainer.total_steps={steps}",
                "trainer.test_freq=0",
                "trainer.val_before_train=false",
                "trainer.progress_bar=false",
                "trainer.loggers=[jsonl]",
                f"trainer.output_dir={out}",
                *overrides,
            ]
        )
        history = fit(cfg).history
    return {
        # What trainer.mixed_precision=auto resolved to on this CPU (bf16 where it has bf16
        # instructions).
        "precision": fsdp.resolve_precision(cfg.trainer.mixed_precision, "cpu"),
        "step_times_s": [row["timing_s/step"] for row in history],
        "stages_s": {
            s: statistics.median(row.get(f"timing_s/{s}", 0.0) for row in history) for s in STAGES
        },
        "logprob_diff_max": max(row.get("rollout/logprob_diff_max", 0.0) for row in history),
        "response_length_mean": statistics.mean(row["response_length/mean"] for row in history),
    }


def child(argv: list[str]) -> None:
    """One configuration in this process; prints its result as one tagged JSON line."""
    side, model_dir, steps = argv[0], Path(argv[1]), int(argv[2])
    options = argv[3:]
    if side == "trl":
        result = run_trl(model_dir, steps, dict(o.split("=", 1) for o in options))
    else:
        result = run_mmrl(model_dir, steps, side.removeprefix("mmrl-"), options)
    result["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(RESULT_TAG + json.dumps(result), flush=True)


def launch(side: str, model_dir: Path, steps: int, options: list[str]) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.bench_vs_trl",
        "--child",
        side,
        str(model_dir),
        str(steps),
        *options,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_TAG)]
    if proc.returncode or not lines:
        sys.exit(f"{side} {options} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    result = json.loads(lines[-1].removeprefix(RESULT_TAG))
    result["median_step_s"] = statistics.median(result["step_times_s"])
    return result


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="10m")
    parser.add_argument("--engine", choices=("hf", "vllm"), default="hf")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument(
        "--name", default=None, help="results file name (default: vs_trl_<size>_<engine>)"
    )
    parser.add_argument(
        "--trl",
        action="append",
        default=None,
        help="a TRL configuration: space-separated GRPOConfig field=value "
        "(repeatable; default: bf16=false, TRL in fp32)",
    )
    parser.add_argument(
        "--mmrl",
        action="append",
        default=None,
        help="an mmrl configuration: space-separated overrides (repeatable; "
        "default: none, mmrl's defaults)",
    )
    args = parser.parse_args()
    configs = [("trl", shlex.split(o)) for o in args.trl or ["bf16=false"]]
    configs += [(f"mmrl-{args.engine}", shlex.split(o)) for o in args.mmrl or [""]]
    hidden, layers = SIZES[args.size]
    runs: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        params = build_model(Path(tmp), hidden, layers)
        print(
            f"model: {params / 1e6:.1f}M parameters (hidden {hidden}, {layers} layers); "
            f"load {os.getloadavg()}",
            flush=True,
        )
        for repeat in range(args.repeats):
            for side, options in configs:
                result = launch(side, Path(tmp), args.steps, options)
                result.update(
                    side=side, options=options, repeat=repeat, load_avg_1min=os.getloadavg()[0]
                )
                runs.append(result)
                print(
                    f"{side} {' '.join(options) or '(defaults)'}: median step "
                    f"{result['median_step_s']:.2f} s, mean response "
                    f"{result['response_length_mean']:.1f} tokens, "
                    f"peak RSS {result['peak_rss_gib']:.2f} GiB"
                    + (
                        f", {result['precision']}, stages {fmt_stages(result['stages_s'])}, "
                        "logprob_diff_max "
                        f"{result['logprob_diff_max']:.2e}"
                        if "stages_s" in result
                        else ""
                    ),
                    flush=True,
                )
    summarise(runs)
    write_results(
        args.name or f"vs_trl_{args.size}_{args.engine}",
        runs,
        "python -m benchmarks.bench_vs_trl " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
        params=params,
    )


def fmt_stages(stages: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.2f}" for k, v in stages.items() if v > 0.005)


def summarise(runs: list[dict]) -> None:
    """One row per configuration: median over repeats of the median step, and the speed-up
    over the first TRL configuration measured in the same repeat."""
    print(
        "\n| side | options | median step (s) | vs TRL (1st config) | mean response (tokens) "
        "| peak RSS (GiB) |"
    )
    print("|---|---|---|---|---|---|")
    keys = []
    for r in runs:
        key = (r["side"], tuple(r["options"]))
        if key not in keys:
            keys.append(key)
    for side, options in keys:
        mine = [r for r in runs if (r["side"], tuple(r["options"])) == (side, options)]
        step = statistics.median(r["median_step_s"] for r in mine)
        ratio = statistics.median(first_trl(runs, r["repeat"]) / r["median_step_s"] for r in mine)
        peak = max(r["peak_rss_gib"] for r in mine)
        length = statistics.mean(r["response_length_mean"] for r in mine)
        print(
            f"| {side} | {' '.join(options) or 'defaults'} | {step:.2f} | {ratio:.2f}x | "
            f"{length:.1f} | {peak:.2f} |"
        )


def first_trl(runs: list[dict], repeat: int) -> float:
    return next(r["median_step_s"] for r in runs if r["side"] == "trl" and r["repeat"] == repeat)


if __name__ == "__main__":
    main()
