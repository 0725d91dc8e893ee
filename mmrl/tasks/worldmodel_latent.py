"""Latent world-model RL: GRPO on a Gaussian latent policy, rewarded on decoded frames.

Prompts are windows of environment trajectories (K context frames + actions); a
response is F future latents sampled by :mod:`mmrl.models.latent_family`, decoded to frames
by the latent autoencoder and scored by frame verifiers (by default -(MAE + LPIPS)).
The starting model is made here (:meth:`WorldModelLatentTask.initial_model`): data are
generated, the autoencoder is trained and the policy is pretrained by maximum
likelihood, each cached under ``task.work_dir`` by a hash of its settings.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mmrl.errors import CheckpointError
from mmrl.models.latent_policy import (
    AUTOENCODER_DIR,
    GaussianLatentPolicy,
    LatentPolicyConfig,
)
from mmrl.processors.latent import FrameWindows, LatentWorldModelProcessor, frame_windows
from mmrl.tasks.base import Task, TaskData, register_task, task_config
from mmrl.worldmodel import frames as F
from mmrl.worldmodel.data import generate_splits
from mmrl.worldmodel.envs import make_env
from mmrl.worldmodel.latent_ae import AEConfig, LatentAutoencoder, train_latent_ae
from mmrl.worldmodel.latent_pretrain import latent_windows, pretrain_latent_policy
from mmrl.worldmodel.tokenizer import AETrainConfig

if TYPE_CHECKING:
    from mmrl.config import RunConfig

log = logging.getLogger(__name__)


@dataclass
class LatentPretrainConfig:
    """Maximum-likelihood pretraining of the policy: a budget fixed before RL."""

    steps: int = 800
    batch_size: int = 64
    lr: float = 1e-3
    val_every: int = 100


@dataclass
class WorldModelLatentConfig:
    name: str = "worldmodel_latent"
    env: str = "push"  # a registered environment: push (continuous physics) | grid
    env_config: dict[str, Any] = field(default_factory=dict)
    work_dir: str = "outputs/worldmodel_latent/push"  # data/, ae/, policy_init/ (cached)
    seed: int = 0  # data, autoencoder and pretraining seed (the RL seed is trainer.seed)
    train_trajectories: int = 256
    val_trajectories: int = 32  # held out: other env seeds, never trained on
    test_trajectories: int = 32  # held out again: read only by final comparisons
    length: int = 16
    context: int = 2  # K context frames per prompt
    future: int = 2  # F predicted frames per response (one policy step each)
    val_windows: int = 64  # held-out prompts scored by validation (evenly spaced)
    autoencoder: AEConfig = field(default_factory=AEConfig)
    autoencoder_train: AETrainConfig = field(default_factory=lambda: AETrainConfig(steps=400))
    policy: dict[str, Any] = field(
        default_factory=dict
    )  # LatentPolicyConfig overrides (hidden, log-std range)
    pretrain: LatentPretrainConfig = field(default_factory=LatentPretrainConfig)
    progress_bar: bool = True


@register_task("worldmodel_latent")
class WorldModelLatentTask(Task[FrameWindows]):
    """Interface beyond :class:`Task`: ``data_dirs``, ``autoencoder`` and ``policy_config``."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.cfg: WorldModelLatentConfig = task_config(WorldModelLatentConfig, cfg)
        self.name = self.cfg.name

    def data_dirs(self) -> tuple[Path, Path, Path]:
        """Generate (or reuse) the train, val and test trajectory datasets (env seeds drawn
        from ``seed``, ``seed + 1`` and ``seed + 2``)."""
        c, root = self.cfg, Path(self.cfg.work_dir) / "data"
        env = make_env(c.env, **c.env_config)
        sizes = {"train": c.train_trajectories, "val": c.val_trajectories}
        sizes["test"] = c.test_trajectories
        dirs = generate_splits(env, sizes, c.length, root, c.seed, c.progress_bar)
        return dirs["train"], dirs["val"], dirs["test"]

    def autoencoder(self) -> LatentAutoencoder:
        train, _, _ = self.data_dirs()
        c = self.cfg
        settings = AETrainConfig(**{**asdict(c.autoencoder_train), "seed": c.seed})
        return train_latent_ae(
            train,
            Path(c.work_dir) / "ae",
            cfg=c.autoencoder,
            train=settings,
            progress=c.progress_bar,
        )

    def policy_config(self) -> LatentPolicyConfig:
        action_dim = make_env(self.cfg.env, **self.cfg.env_config).action_spec.dim
        return LatentPolicyConfig(
            **{"context": self.cfg.context, "action_dim": action_dim, **self.cfg.policy}
        )

    def build_data(self, seed: int) -> TaskData[FrameWindows]:
        """Train windows (all), ``val_windows`` val windows and every test window; the data
        seed is ``task.seed``."""
        train, val, test = self.data_dirs()
        c = self.cfg
        return TaskData(
            train=frame_windows(train, c.context, c.future),
            val=frame_windows(val, c.context, c.future, max_windows=c.val_windows),
            test=frame_windows(test, c.context, c.future),
        )

    def initial_model(self, cfg: RunConfig) -> tuple[Path, dict[str, float]]:
        """The pretrained policy folder (with its ``autoencoder/``), made once per settings."""
        c = self.cfg
        train_dir, val_dir, _ = self.data_dirs()  # the test split stays unseen
        ae = self.autoencoder()
        ae_record = json.loads((Path(c.work_dir) / "ae" / F.CACHE_FILE).read_text())
        policy_cfg = self.policy_config()
        out = Path(c.work_dir) / "policy_init"
        key = F.cache_key(
            train_dir,
            kind="latent_policy",
            ae_key=ae_record["key"],
            policy=asdict(policy_cfg),
            pretrain=asdict(c.pretrain),
            seed=c.seed,
        )
        record = F.cached(out, key)
        if record is None:
            record = self._pretrain(ae, policy_cfg, train_dir, val_dir, out)
            F.write_cache(out, key, record)
        metrics = {
            f"pretrain/{k}": float(v)
            for k, v in record.items()
            if k in ("val_nll", "val_mse", "steps")
        }
        metrics["pretrain/ae_psnr"] = float(ae_record["psnr"])
        return out, metrics

    def _pretrain(
        self, ae, policy_cfg, train_dir: Path, val_dir: Path, out: Path
    ) -> dict[str, float]:
        import torch

        c, p = self.cfg, self.cfg.pretrain
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(c.seed)
            policy = GaussianLatentPolicy(policy_cfg)
            history = pretrain_latent_policy(
                policy,
                latent_windows(train_dir, ae, c.context),
                latent_windows(val_dir, ae, c.context),
                steps=p.steps,
                batch_size=p.batch_size,
                lr=p.lr,
                val_every=p.val_every,
                seed=c.seed,
                progress=c.progress_bar,
            )
        policy.save_pretrained(out)
        ae.save_pretrained(out / AUTOENCODER_DIR)
        last = history[-1]
        log.info("latent policy pretrained: %s", last)
        return {"steps": p.steps, "val_nll": last["val/nll"], "val_mse": last["val/mse"]}

    def build_prompt_processor(self, model_path: Path, cfg: RunConfig) -> LatentWorldModelProcessor:
        ae_dir = Path(model_path) / AUTOENCODER_DIR
        if not ae_dir.is_dir():
            raise CheckpointError(
                f"{model_path} has no {AUTOENCODER_DIR}/ folder: a latent policy folder carries "
                "the autoencoder that defines its latent space"
            )
        return LatentWorldModelProcessor(
            LatentAutoencoder.from_pretrained(ae_dir), self.cfg.context, self.cfg.future
        )

    def env(self):
        """A fresh instance of the task's environment (for state reading and planning)."""
        return make_env(self.cfg.env, **self.cfg.env_config)


def evaluate_latent_policy(
    cfg: RunConfig, model_path: str | Path, greedy: bool, seed: int = 0
) -> dict[str, float]:
    """Test-split metrics of a latent policy folder with the run's verifiers (``cfg.reward``).

    ``greedy`` predicts each frame's mean; otherwise frames are sampled at
    ``rollout.val_kwargs.temperature`` with ``seed``. The same prompts, decoding and
    verifiers as validation in the fit loop, so a base and a tuned policy compare
    like for like. Keys: ``score`` and each verifier's metrics (``psnr/mean``, ...).
    """
    from contextlib import closing

    import numpy as np

    from mmrl.models import get_family
    from mmrl.rollout.module import ModuleRollout
    from mmrl.sampling import SamplingParams
    from mmrl.verifiers import VerifierRunner

    task = WorldModelLatentTask(cfg.task)
    processor = task.build_prompt_processor(Path(model_path), cfg)
    prompts = processor.encode_dataset(task.build_data(seed).test, "test")
    family = get_family("latent")
    engine = ModuleRollout(family.load(Path(model_path)), family)
    sampling = SamplingParams(
        **processor.sampling_overrides(),
        do_sample=not greedy,
        temperature=cfg.actor_rollout_ref.rollout.val_kwargs.temperature,
        seed=seed,
    )
    batch = processor.decode(engine.generate(prompts, sampling))
    with closing(VerifierRunner.from_config(cfg.reward)) as runner:
        out = runner.run(batch)
    metrics = {k.removeprefix("reward/"): float(np.mean(v)) for k, v in out.metrics.items()
               if "/errors" not in k and "timing" not in k}  # fmt: skip
    metrics["score"] = float(np.mean(out.scores))
    return metrics


__all__ = [
    "WorldModelLatentConfig",
    "WorldModelLatentTask",
    "evaluate_latent_policy",
]
