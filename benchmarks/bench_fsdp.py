"""Step time and peak memory per worker with 1 vs 2 FSDP workers on the same global batch.

    .venv/bin/python benchmarks/bench_fsdp.py --steps 3

Runs full RL steps (``mmrl.trainer.fit.rl_step``: generate, score, log-probs,
reference, update, weight sync) on a random Qwen2 built from config, in three
layouts that all use the machine's cores:

- ``embedded``: one worker in this process (one-rank FSDP2 group, no Ray);
- ``ray x1``: one Ray worker reserving ``--cores`` CPUs;
- ``ray x2``: two Ray workers with ``--cores / 2`` CPUs each, gloo between them.

Peak memory is each worker process's peak RSS (the embedded worker shares its
process with the driver). Weight sync is ``timing_s/update_weights``: gathering
the full weights from the shards and loading them into the rollout engine; the
transformers engine generates from the actor's own module, so it has nothing to load.
Results go to the section "FSDP2 workers: 1 vs 2" of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from contextlib import closing
from pathlib import Path

import torch

from mmrl.algos import build_kl_controller
from mmrl.config import load_config
from mmrl.hybrid import build_workers, init_ray
from mmrl.tasks import get_task
from mmrl.tasks.text_addition import build_char_tokenizer
from mmrl.trainer.fit import PromptLoader, rl_step
from mmrl.utils.seed import set_seed
from mmrl.verifiers import VerifierRunner

TIMINGS = ("step", "gen", "old_log_prob", "ref", "update_actor", "update_weights")


def build_model(out: Path, hidden: int, layers: int) -> tuple[Path, int]:
    """A random addition-task Qwen2 with ``hidden``-wide, ``layers``-deep blocks; returns (dir,
    params).
    """
    task = get_task("text_addition")(
        {
            "name": "text_addition",
            "model": {
                "hidden_size": hidden,
                "intermediate_size": 4 * hidden,
                "num_hidden_layers": layers,
                "num_attention_heads": hidden // 64,
                "num_key_value_heads": hidden // 64,
            },
        }
    )
    tokenizer = build_char_tokenizer()
    torch.manual_seed(0)
    model = task.build_model(tokenizer)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out, sum(p.numel() for p in model.parameters())


def run_layout(name: str, overrides: list[str], args: argparse.Namespace) -> dict[str, float]:
    """Median timings over ``args.steps`` RL steps after one warm-up step, and per-worker peak
    RSS."""
    cfg = load_config(overrides)
    set_seed(cfg.trainer.seed)
    task = get_task("text_addition")(cfg.task)
    processor = task.build_prompt_processor(Path(cfg.actor_rollout_ref.model.path), cfg)
    prompts = processor.encode_dataset(task.build_data(cfg.trainer.seed).train, "train")
    loader = PromptLoader(prompts, cfg.data.train_batch_size, shuffle=True, seed=0)
    kl_ctrl = build_kl_controller(cfg.algorithm.kl_ctrl)
    history, runner = [], VerifierRunner.from_config(cfg.reward)
    workers = build_workers(cfg, cfg.actor_rollout_ref.model.path, need_ref=True, need_critic=False)
    with workers, closing(runner):
        for step in range(1, args.steps + 2):
            metrics = rl_step(
                cfg, step, loader.next(), workers.actor, None, processor, kl_ctrl, runner
            )
            print(f"{name} step {step}: {metrics['timing_s/step']:.2f} s", flush=True)
            history.append(metrics)
        memory = workers.actor.memory_stats()
    measured = history[1:]
    row = {k: statistics.median(m[f"timing_s/{k}"] for m in measured) for k in TIMINGS}
    row["peak_rss_gib"] = max(m["peak_rss_gib"] for m in memory)
    return row


def markdown(rows: dict[tuple[str, str], dict[str, float]]) -> str:
    lines = [
        "| rollout | layout | step (s) | gen (s) | old log-prob + ref (s) | update (s) "
        "| weight sync (s) | sync / step | peak RSS per worker (GiB) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for (rollout, layout), r in rows.items():
        lines.append(
            f"| {rollout} | {layout} | {r['step']:.2f} | {r['gen']:.2f} | "
            f"{r['old_log_prob'] + r['ref']:.2f} "
            f"| {r['update_actor'] - r['update_weights']:.2f} | {r['update_weights']:.3f} "
            f"| {100 * r['update_weights'] / r['step']:.1f} % | {r['peak_rss_gib']:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--steps", type=int, default=3, help="measured RL steps per layout (after 1 warm-up)"
    )
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--cores", type=int, default=2, help="CPUs all workers of a layout share")
    parser.add_argument(
        "--rollout", nargs="+", default=["hf", "vllm"], help="rollout engines to run"
    )
    parser.add_argument("--layouts", nargs="+", default=["embedded", "ray x1", "ray x2"])
    args = parser.parse_args()

    load_before = os.getloadavg()[1]
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, params = build_model(Path(tmp) / "model", args.hidden, args.layers)
        for rollout in args.rollout:
            common = [
                f"actor_rollout_ref.model.path={model_dir}",
                f"trainer.output_dir={tmp}/run",
                "trainer.progress_bar=false",
                f"actor_rollout_ref.rollout.name={rollout}",
                "data.train_batch_size=8",
                "actor_rollout_ref.rollout.n=8",
                "data.max_response_length=32",
                "actor_rollout_ref.actor.ppo_mini_batch_size=8",
                "actor_rollout_ref.actor.ppo_micro_batch_size=16",
            ]
            layouts = {
                "embedded": common,
                "ray x1": [
                    *common,
                    "trainer.ray_address=auto",
                    f"trainer.ray_num_cpus_per_worker={args.cores}",
                ],
                "ray x2": [
                    *common,
                    "trainer.ray_address=auto",
                    "trainer.n_workers_per_node=2",
                    f"trainer.ray_num_cpus_per_worker={args.cores // 2}",
                ],
            }
            # One local Ray for both Ray layouts: `ray_address=auto` then uses this connection.
            init_ray(
                load_config([*common, f"trainer.ray_num_cpus_per_worker={args.cores}"]).trainer
            )
            for layout in args.layouts:
                rows[rollout, layout] = run_layout(f"{rollout} {layout}", layouts[layout], args)

    print(
        f"\nRandom Qwen2, {params / 1e6:.1f}M parameters ({args.layers} blocks of width "
        f"{args.hidden}); "
        f"median of {args.steps} steps after a warm-up step; {args.cores} cores per layout; "
        f"5-minute load average {load_before:.1f} before, {os.getloadavg()[1]:.1f} after.\n"
    )
    print("`.venv/bin/python " + " ".join(["benchmarks/bench_fsdp.py", *sys.argv[1:]]) + "`\n")
    print(markdown(rows))


if __name__ == "__main__":
    main()
