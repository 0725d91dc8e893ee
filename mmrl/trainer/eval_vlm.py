"""Held-out accuracy of a VLM checkpoint on a parquet file: ``mmrl eval --parquet``.

    mmrl eval --checkpoint outputs/visual_counting_grpo/actor --parquet val.parquet

The checkpoint is a ``save_pretrained`` directory with its processor (what ``mmrl train``
writes to ``<output_dir>/actor``); the parquet file follows the layout of
:mod:`mmrl.data.parquet`. Prompts are built as ``task=vision_parquet`` builds them (the
same chat template and answer-format instruction as training), responses are decoded
greedily by default, and a verifier (``math_answer``: the ``<answer>`` against the
``answer`` column) scores them. Prints and returns the accuracy.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

# The answer-format instruction that task=vision_parquet (and visual_counting) append.
DEFAULT_INSTRUCTION = " Think in <think></think>, then answer in <answer></answer>."


@dataclass
class EvalResult:
    accuracy: float
    num_samples: int
    num_filtered: int
    wall_time_s: float
    per_sample: list[float] = field(default_factory=list)
    responses: list[str] = field(default_factory=list)


def evaluate_parquet(
    checkpoint: str | Path,
    files: list[str],
    *,
    max_rows: int | None = None,
    batch_size: int = 32,
    max_prompt_length: int = 1024,
    max_response_length: int = 256,
    do_sample: bool = False,
    temperature: float = 1.0,
    seed: int = 0,
    verifier: str = "math_answer",
    instruction: str | None = None,
    system_prompt: str | None = None,
    filter_overlong_prompts: bool = False,
) -> EvalResult:
    """Generate one response per row of ``files`` with ``checkpoint`` and score it."""
    from mmrl.config import RunConfig
    from mmrl.models import policy_family
    from mmrl.processors.vision_prompts import VisionPromptProcessor
    from mmrl.sampling import SamplingParams
    from mmrl.tasks.vision_parquet import VisionParquetTask
    from mmrl.verifiers import get_verifier

    start = time.perf_counter()
    task_cfg = {
        "train_files": list(files),
        "model_path": str(checkpoint),
        "max_train_rows": max_rows,
        "system_prompt": system_prompt,
    }
    if instruction is not None:
        task_cfg["instruction"] = instruction
    task = VisionParquetTask(task_cfg)
    dataset = task.build_data(seed).train
    run = RunConfig()
    run.data.max_prompt_length = max_prompt_length
    run.data.filter_overlong_prompts = filter_overlong_prompts
    processor = VisionPromptProcessor.from_pretrained(checkpoint, run, task.samples)
    prompts = processor.encode_dataset(dataset, "eval")
    family = policy_family(checkpoint)
    model = family.load(Path(checkpoint)).eval()
    tokenizer = processor.vision.tokenizer
    score_fn = get_verifier(verifier)
    scores, texts = [], []
    for i, chunk in enumerate(prompts.split(batch_size)):
        sampling = SamplingParams(
            max_tokens=max_response_length,
            temperature=temperature,
            do_sample=do_sample,
            seed=seed + i,
        )
        out = processor.decode(family.generate(model, chunk, sampling, tokenizer))
        scores += [float(s) for s in np.asarray(score_fn(out).scores)]
        texts += list(out["response_text"])
    return EvalResult(
        accuracy=float(np.mean(scores)),
        num_samples=len(scores),
        num_filtered=int(prompts.meta["num_filtered_prompts"]),
        wall_time_s=time.perf_counter() - start,
        per_sample=scores,
        responses=texts,
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--checkpoint", required=True, help="save_pretrained directory (model + processor)"
    )
    parser.add_argument(
        "--parquet", required=True, nargs="+", help="parquet file(s) in the docs/vlm.md layout"
    )
    parser.add_argument("--max-rows", type=int, default=None, help="first N rows of each file")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-prompt-length", type=int, default=1024, help="text + vision tokens")
    parser.add_argument("--max-response-length", type=int, default=256)
    parser.add_argument(
        "--sample", action="store_true", help="sample (temperature) instead of greedy decoding"
    )
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--verifier", default="math_answer", help="a registered verifier or module:function"
    )
    parser.add_argument(
        "--instruction",
        default=DEFAULT_INSTRUCTION,
        help="appended to each problem, as in training",
    )
    parser.add_argument("--system-prompt", default=None)
    parser.add_argument("--filter-overlong-prompts", action="store_true")
    parser.add_argument(
        "--output", default=None, help="write per-sample scores and responses to this JSON file"
    )


def main(args: argparse.Namespace) -> int:
    result = evaluate_parquet(
        args.checkpoint,
        args.parquet,
        max_rows=args.max_rows,
        batch_size=args.batch_size,
        max_prompt_length=args.max_prompt_length,
        max_response_length=args.max_response_length,
        do_sample=args.sample,
        temperature=args.temperature,
        seed=args.seed,
        verifier=args.verifier,
        instruction=args.instruction,
        system_prompt=args.system_prompt,
        filter_overlong_prompts=args.filter_overlong_prompts,
    )
    decoding = f"sampled, temperature {args.temperature}" if args.sample else "greedy"
    print(
        f"accuracy: {result.accuracy:.4f} ({int(round(result.accuracy * result.num_samples))}/"
        f"{result.num_samples}, {args.verifier}, {decoding} decoding)"
    )
    if result.num_filtered:
        print(f"  {result.num_filtered} overlong prompts filtered out")
    print(f"  wall time: {result.wall_time_s:.1f} s")
    if args.output:
        Path(args.output).write_text(
            json.dumps(
                {
                    "accuracy": result.accuracy,
                    "num_samples": result.num_samples,
                    "scores": result.per_sample,
                    "responses": result.responses,
                },
                indent=1,
            )
        )
    return 0
