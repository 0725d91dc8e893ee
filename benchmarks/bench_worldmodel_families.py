"""Three world-model families on the same recordings: token LM, Gaussian latent, flow matching.

    OMP_NUM_THREADS=1 python -m benchmarks.bench_worldmodel_families --seeds 0 1 2 \
        --out outputs/bench_families

One folder of mp4 episodes of the push world (continuous 2-dim actions, made once by
``benchmarks/env_videos.py``) is given to ``mmrl train`` three times, through each family's
own-videos task: ``worldmodel_videos`` (VQ tokens and a Qwen2 LM), ``worldmodel_latent_videos``
(a Gaussian head over autoencoder latents) and ``worldmodel_flow_videos`` (a flow-matching
velocity over the same latents, GRPO over its SDE denoising steps). The three import the same
split by episode (checked), predict the same F = 2 frames from K = 2, run the same number of
GRPO steps per RL seed on one pretrained base each, and are scored on every window of the same
test episodes, which neither pretraining, checkpoint choice nor RL read. Each family keeps its
own task defaults otherwise (batch, group size, learning rate, KL). Copying the last context
frame's pixels is the shared reference; each family's codec ceiling (the true future through
its tokenizer or autoencoder) is its own. Writes benchmarks/results/<--name>.json and prints
Markdown tables.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.env_videos import write_env_videos
from benchmarks.results import mean_std, write_results

FAMILIES = {
    "flow matching": "worldmodel_flow_videos",
    "Gaussian latent": "worldmodel_latent_videos",
    "token LM": "worldmodel_videos",
}
CEILING = {
    "token LM": "tokenizer ceiling (true tokens)",
    "Gaussian latent": "autoencoder ceiling (true future through the AE)",
    "flow matching": "autoencoder ceiling (true future through the AE)",
}
KEYS = (("psnr", 2), ("lpips", 4), ("ssim", 4))
# --smoke: budgets that only check the wiring in a few minutes (no claim rests on them).
SMOKE = {
    "token LM": [
        "++task.pretrain.tokenizer.train.steps=30",
        "++task.pretrain.train.steps=30",
        "++task.pretrain.train.val_every=30",
    ],
    "latent": ["task.autoencoder_train.steps=30", "task.pretrain.steps=30"],
}


def overrides(family: str, videos: Path, out: Path, args: argparse.Namespace) -> list[str]:
    """The family's task on ``videos`` with the shared split, horizon, test set and RL steps."""
    common = [
        f"task={FAMILIES[family]}",
        "trainer.progress_bar=false",
        "trainer.loggers=[jsonl]",
        f"trainer.total_steps={args.steps}",
        f"trainer.test_freq={args.steps}",
        "task.eval.windows=100000",  # every test window, the same for every family
        "task.eval.samples=2",
    ]
    if args.smoke:
        common += SMOKE["token LM" if family == "token LM" else "latent"]
        common += ["task.pretrain.val_every=30"] if family != "token LM" else []
    split = {"val_fraction": args.val_fraction, "test_fraction": args.test_fraction}
    if family == "token LM":
        pre = [f"videos={videos}", "future=2", *(f"{k}={v}" for k, v in split.items())]
        return [
            *common,
            *(f"++task.pretrain.data.{o}" for o in pre),
            f"++task.pretrain.output_dir={out / 'token_pretrain'}",
            "++task.pretrain.progress_bar=false",
            # 1 + K(1 + 64) + (K + F - 1)(1 + 2) + 1 = 141 prompt tokens; F x 64 response
            "data.max_prompt_length=160",
            "data.max_response_length=128",
        ]
    return [
        *common,
        f"task.data.videos={videos}",
        *(f"task.data.{k}={v}" for k, v in split.items()),
        f"task.work_dir={out / 'latent_work'}",  # the latent and flow tasks share data and AE
        "task.progress_bar=false",
        "task.future=2",
    ]


def run_family(family: str, videos: Path, out: Path, args: argparse.Namespace) -> dict:
    """Pretrain once (timed), then one RL run per seed; the test tables and timings."""
    from mmrl.config import load_config
    from mmrl.tasks import get_task
    from mmrl.trainer.fit import fit, prepare_initial_model

    base = overrides(family, videos, out, args)
    first = load_config([*base, f"trainer.output_dir={out / family / 'pretrain_only'}"])
    task = get_task(first.task["name"])(first.task)
    start = time.perf_counter()
    prepare_initial_model(first, task)
    pretrain_s = time.perf_counter() - start
    seeds = {}
    for seed in args.seeds:
        run = out / family.replace(" ", "_") / f"seed{seed}"
        cfg = load_config([*base, f"trainer.seed={seed}", f"trainer.output_dir={run}"])
        result = fit(cfg)
        steps = [r["timing_s/step"] for r in result.history if "timing_s/step" in r]
        table = json.loads((run / "worldmodel_eval.json").read_text())
        if "reference" not in table:  # the token task reports its references apart
            from benchmarks.bench_worldmodel import references

            table["reference"] = references(cfg, cfg.task["name"])[0]
        seeds[seed] = {
            "table": table,
            "rl_wall_time_s": result.wall_time_s,
            "grpo_step_s": float(np.median(steps)),
            "peak_memory_gib": result.peak_memory_gib,
        }
        print(f"{family} seed {seed}: {result.wall_time_s:.0f} s", flush=True)
    return {"pretrain_s": pretrain_s, "seeds": seeds, "test_videos": test_videos(task)}


def test_videos(task) -> list[str]:
    """The recordings a task imported as its test split."""
    if hasattr(task, "data_dirs"):
        test_dir = task.data_dirs()[2]
    else:
        from mmrl.worldmodel.pretrain import prepare_data

        test_dir = prepare_data(task.pretrain_cfg)[2]
    return sorted(json.loads((Path(test_dir) / "index.json").read_text())["videos"])


def copy_last_pixels(test) -> dict[str, float]:
    """The trivial world model on the raw pixels: every future frame is the last context frame."""
    from mmrl.tasks.worldmodel_eval import frame_scores

    last = np.repeat(test.context[:, -1:], test.future.shape[1], axis=1)
    scores = frame_scores(last, test.future, np.ones(len(test), bool), None)
    return {k: float(np.nanmean(v)) for k, v in scores.items()}


def test_windows(videos: Path, out: Path, args: argparse.Namespace):
    from mmrl.config import load_config
    from mmrl.tasks import get_task

    cfg = load_config(overrides("Gaussian latent", videos, out, args))
    return get_task(cfg.task["name"])(cfg.task).build_data(0).test


def markdown(results: dict[str, dict], copy: dict[str, float], seeds: list[int]) -> str:
    head = "| family | model | decoding | PSNR dB ↑ | LPIPS ↓ | SSIM ↑ |"
    lines = [head, "|---|---|---|---|---|---|"]
    lines.append(
        "| – | copy last frame (pixels) | – | "
        + " | ".join(f"{copy[k]:.{d}f}" for k, d in KEYS) + " |"
    )  # fmt: skip
    for family, res in results.items():
        runs = list(res["seeds"].values())
        ceiling = runs[0]["table"]["reference"][CEILING[family]]
        lines.append(
            f"| {family} | codec ceiling | – | "
            + " | ".join(f"{ceiling[k]:.{d}f}" for k, d in KEYS) + " |"
        )  # fmt: skip
        for decoding in ("greedy", "sampled"):
            for model, label in (("base", "pretrained"), ("rl", "+ GRPO")):
                cells = [mean_std([r["table"][model][decoding][k] for r in runs], d)
                         for k, d in KEYS]  # fmt: skip
                lines.append(f"| {family} | {label} | {decoding} | " + " | ".join(cells) + " |")
            deltas = [
                mean_std([r["table"]["rl"][decoding][k] - r["table"]["base"][decoding][k]
                          for r in runs], d)
                for k, d in KEYS
            ]  # fmt: skip
            lines.append(f"| {family} | Δ (RL − base) | {decoding} | " + " | ".join(deltas) + " |")
    time_head = "| family | pretraining s | GRPO step s | RL run s (with test eval) | peak GiB |"
    lines += ["", time_head, "|---|---|---|---|---|"]
    for family, res in results.items():
        runs = list(res["seeds"].values())
        lines.append(
            f"| {family} | {res['pretrain_s']:.0f} | "
            f"{mean_std([r['grpo_step_s'] for r in runs], 2)} | "
            f"{mean_std([r['rl_wall_time_s'] for r in runs], 0)} | "
            f"{max(r['peak_memory_gib'] for r in runs):.2f} |"
        )
    lines.append(f"\nRL seeds {seeds}: mean ± sample std over seeds; one pretrained base each.")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=40, help="GRPO steps per RL seed, every family")
    p.add_argument("--episodes", type=int, default=320)
    p.add_argument("--size", type=int, default=32, help="frame side of the push recordings")
    p.add_argument("--val-fraction", type=float, default=0.1)
    p.add_argument("--test-fraction", type=float, default=0.05)
    p.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    p.add_argument("--out", type=Path, default=Path("outputs/bench_families"))
    p.add_argument("--name", default="worldmodel_families")
    p.add_argument("--smoke", action="store_true", help="tiny budgets: check the wiring only")
    args = p.parse_args()
    videos = args.out / "videos"
    if not videos.exists():
        write_env_videos("push", videos, args.episodes, 16, seed=0, size=args.size)
    results = {}
    for family in args.families:  # a rerun keeps the families that finished
        done = args.out / family.replace(" ", "_") / "family.json"
        if not done.exists():
            done.parent.mkdir(parents=True, exist_ok=True)
            done.write_text(json.dumps(run_family(family, videos, args.out, args), indent=1))
        results[family] = json.loads(done.read_text())
    sources = {tuple(r.pop("test_videos")) for r in results.values()}
    assert len(sources) == 1, "the families imported different test episodes"
    test = test_windows(videos, args.out, args)
    copy = copy_last_pixels(test)
    table = markdown(results, copy, args.seeds)
    print(f"\n{len(test)} test windows\n\n{table}")
    write_results(
        args.name,
        {family: res for family, res in results.items()},
        "OMP_NUM_THREADS=1 python -m benchmarks.bench_worldmodel_families "
        + " ".join(sys.argv[1:]),
        seeds=args.seeds,
        copy_last_pixels=copy,
        test_windows=len(test),
    )
    (args.out / "families.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
