"""Multi-seed latent world-model GRPO: test-split metrics of the base and the tuned policy.

    python -m benchmarks.bench_worldmodel_latent --seeds 0 1 2 [hydra overrides]

The base (data, autoencoder, MLE-pretrained policy) is made once under
``task.work_dir`` and shared by every seed; each seed runs ``mmrl train
task=worldmodel_latent`` with ``trainer.seed=<seed>``. Base and tuned policies are
evaluated on every window of the test trajectories (which neither pretraining nor
validation read) with the same decoding, both sampled and
greedy (the mean latent), next to the trivial world models: copying the last context
frame's pixels, and copying its latent (decoded by the same autoencoder). With ``--planner-episodes
N`` the planner (random shooting on the push
world's ``reach`` task) also runs with each model, with the true simulator and at random.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from contextlib import closing
from pathlib import Path

import numpy as np

from benchmarks.results import mean_std, write_results
from mmrl.config import load_config
from mmrl.tasks.worldmodel_latent import WorldModelLatentTask, evaluate_latent_policy
from mmrl.trainer.fit import fit
from mmrl.verifiers import VerifierRunner

KEYS = ("score", "mae/mean", "lpips/mean", "psnr/mean", "ssim/mean", "state_match/mean")


def copy_last_frame(cfg) -> dict[str, float]:
    """The trivial world model: every future frame is the last context frame."""
    import torch

    from mmrl.protocol import Batch

    windows = WorldModelLatentTask(cfg.task).build_data(0).test
    f = windows.future.shape[1]
    pred = np.repeat(windows.context[:, -1:], f, axis=1)
    batch = Batch.from_dict(
        {"pred_frames": torch.from_numpy(pred), "gt_frames": torch.from_numpy(windows.future)}
    )
    with closing(VerifierRunner.from_config(cfg.reward)) as runner:
        out = runner.run(batch)
    metrics = {k.removeprefix("reward/"): float(np.mean(v)) for k, v in out.metrics.items()}
    return {**metrics, "score": float(np.mean(out.scores))}


def copy_last_latent(cfg, base: Path, tmp: Path) -> dict[str, float]:
    """The trivial world model in latent space: an untrained policy's mean is the last
    context latent (its output layer starts at zero), decoded by the same autoencoder."""
    from mmrl.models.latent_policy import GaussianLatentPolicy

    trained = GaussianLatentPolicy.from_pretrained(base)
    copy = GaussianLatentPolicy(trained.cfg)
    copy.name_or_path = str(base)  # save_pretrained copies its autoencoder/
    copy.save_pretrained(tmp / "copy_last_latent")
    return evaluate_latent_policy(cfg, tmp / "copy_last_latent", greedy=True)


def planner_rows(cfg, models: dict[str, str], episodes: int) -> dict[str, dict[str, float]]:
    from mmrl.models.latent_policy import AUTOENCODER_DIR, GaussianLatentPolicy
    from mmrl.worldmodel.latent_ae import LatentAutoencoder
    from mmrl.worldmodel.planner import LatentPredictor, SimulatorPredictor, evaluate_planner

    env = WorldModelLatentTask(cfg.task).env()
    predictors = {"random": None, "simulator": SimulatorPredictor(env)}
    for name, path in models.items():
        ae = LatentAutoencoder.from_pretrained(Path(path) / AUTOENCODER_DIR)
        predictors[name] = LatentPredictor(GaussianLatentPolicy.from_pretrained(path), ae)
    return evaluate_planner(env, "reach", predictors, episodes=episodes)


def fmt(values: list[float]) -> str:
    return mean_std(values, 4)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--planner-episodes", type=int, default=0)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    base_overrides = [
        "task=worldmodel_latent",
        "trainer.progress_bar=false",
        "trainer.loggers=[jsonl]",
        *args.overrides,
    ]
    eval_cfg = load_config(base_overrides)
    test_windows = len(WorldModelLatentTask(eval_cfg.task).build_data(0).test)
    rows: dict[tuple[str, str], list[dict[str, float]]] = {}
    tuned: dict[int, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            out = Path(tmp) / f"seed{seed}"
            cfg = load_config(
                [*base_overrides, f"trainer.seed={seed}", f"trainer.output_dir={out}"]
            )
            result = fit(cfg)
            val = result.series("val/score/mean")
            kl = result.series("actor/kl_loss")
            print(
                f"seed {seed}: validation score {val[0]:.4f} -> {val[-1]:.4f}, final KL loss "
                f"{kl[-1]:.2f}, "
                f"{result.wall_time_s:.0f} s, {result.peak_memory_gib:.2f} GiB",
                flush=True,
            )
            base = Path(cfg.task["work_dir"]) / "policy_init"
            tuned[seed] = str(out / "actor")
            for greedy in (False, True):
                decoding = "greedy" if greedy else "sampled"
                if seed == args.seeds[0]:
                    rows.setdefault(("MLE base", decoding), []).append(
                        evaluate_latent_policy(eval_cfg, base, greedy)
                    )
                rows.setdefault(("GRPO", decoding), []).append(
                    evaluate_latent_policy(eval_cfg, out / "actor", greedy)
                )
        rows[("copy last frame (pixels)", "-")] = [copy_last_frame(eval_cfg)]
        rows[("copy last latent (through the AE)", "greedy")] = [
            copy_last_latent(eval_cfg, base, Path(tmp))
        ]
        print(f"\ntest windows: {test_windows}; GRPO rows: mean ± std over seeds {args.seeds}\n")
        print(
            "| model | decoding | score -(MAE+LPIPS) | MAE | LPIPS | PSNR dB | SSIM | state match |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for (model, decoding), runs in sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            cells = " | ".join(fmt([r[k] for r in runs]) for k in KEYS)
            print(f"| {model} | {decoding} | {cells} |")
        write_results(
            "worldmodel_latent",
            {f"{model} ({decoding})": runs for (model, decoding), runs in rows.items()},
            "python -m benchmarks.bench_worldmodel_latent " + " ".join(sys.argv[1:]),
            seeds=args.seeds,
        )
        if args.planner_episodes:
            models = {"MLE base": str(base), "GRPO": tuned[args.seeds[0]]}
            results = planner_rows(eval_cfg, models, args.planner_episodes)
            print(
                f"\nplanner on push/reach, {args.planner_episodes} episodes (GRPO: seed "
                f"{args.seeds[0]})\n"
            )
            print("| world model | success rate | mean steps | mean final distance (px) |")
            print("|---|---|---|---|")
            for name, r in results.items():
                print(
                    f"| {name} | {r['success_rate']:.2f} | {r['mean_steps']:.1f} | "
                    f"{r['mean_final_cost']:.1f} |"
                )


if __name__ == "__main__":
    main()
