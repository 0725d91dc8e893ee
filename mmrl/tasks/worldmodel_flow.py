"""Flow-matching world-model RL: GRPO over the denoising steps of a velocity model.

The latent world-model task (:mod:`mmrl.tasks.worldmodel_latent`) with a flow-matching
policy (:mod:`mmrl.models.flow_policy`) in place of the Gaussian head: the same trajectory
windows (generated, or imported from recordings with ``task=worldmodel_flow_videos``),
autoencoder, prompt processor and frame verifiers (by default -(MAE + LPIPS)).
:meth:`WorldModelFlowTask.initial_model` pretrains the velocity by flow matching, cached
under ``task.work_dir`` by a hash of its settings (the sampler settings are written into
the policy's ``flow_policy.json`` and need no retraining). After RL, the latent task's
``on_fit_end`` compares the pretrained and the RL policy on the test split, ODE and SDE, beside
copying the last frame and the autoencoder's ceiling.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mmrl.models.flow_policy import CONFIG_FILE, SAMPLER_KEYS, FlowPolicyConfig
from mmrl.tasks.base import register_task
from mmrl.tasks.worldmodel_latent import WorldModelLatentConfig, WorldModelLatentTask
from mmrl.worldmodel import frames as F
from mmrl.worldmodel.data import TrajectoryDataset

if TYPE_CHECKING:
    from mmrl.config import RunConfig

log = logging.getLogger(__name__)
POLICY_DIR = "flow_policy_init"  # under task.work_dir, beside the latent task's policy_init/


@dataclass
class FlowSamplerConfig:
    """How the velocity model samples as a policy (``flow_policy.json``; no retraining)."""

    num_steps: int = 8  # denoising steps per predicted frame; the last is deterministic
    noise_level: float = 0.7  # the SDE's a: sigma_t = a sqrt(t / (1 - t)); 0 is the ODE
    train_steps: int = 0  # stochastic steps per frame RL trains on, drawn per rollout; 0: all


@dataclass
class FlowPretrainConfig:
    """Flow-matching pretraining of the velocity: a budget fixed before RL."""

    steps: int = 4000
    batch_size: int = 64
    lr: float = 1e-3
    val_every: int = 500


@dataclass
class FlowHeldOutEval:
    """The final base-vs-RL comparison on the test split."""

    windows: int = 128  # test windows, evenly spaced over the split
    samples: int = 2  # sampled predictions per window (greedy, the ODE, uses one)
    temperature: float = 1.0  # multiplies the noise level when sampling
    # A predicted frame that moves less than this (mean |pixel change| in [0, 1]) while the
    # true frame moves more counts as repeated (mmrl.verifiers.repetition).
    repetition_tau: float = 0.01


@dataclass
class WorldModelFlowConfig(WorldModelLatentConfig):
    name: str = "worldmodel_flow"
    work_dir: str = "outputs/worldmodel_latent/push"  # shares the latent task's data and AE
    # FlowVelocityPolicy architecture overrides (block_out_channels, layers_per_block, ...)
    policy: dict[str, Any] = field(default_factory=dict)
    sampler: FlowSamplerConfig = field(default_factory=FlowSamplerConfig)
    pretrain: FlowPretrainConfig = field(default_factory=FlowPretrainConfig)
    eval: FlowHeldOutEval = field(default_factory=FlowHeldOutEval)


@register_task("worldmodel_flow_videos")
@register_task("worldmodel_flow")
class WorldModelFlowTask(WorldModelLatentTask):
    """The latent task's data (generated or recorded), autoencoder, processor and test-split
    comparison; a flow policy to start from."""

    policy_family = "flow_latent"
    config_class = WorldModelFlowConfig

    def policy_config(self) -> FlowPolicyConfig:
        """The flow policy's architecture and sampler for this task's environment and AE."""
        c = self.cfg
        action_dim = TrajectoryDataset(self.data_dirs()[0]).info.action.dim
        return FlowPolicyConfig(
            **{
                "context": c.context,
                "action_dim": action_dim,
                "latent_channels": c.autoencoder.latent_channels,
                **c.policy,
                **asdict(c.sampler),
            }
        )

    def initial_model(self, cfg: RunConfig) -> tuple[Path, dict[str, float]]:
        """The pretrained flow policy folder (with its ``autoencoder/``), made once per
        architecture and pretraining settings; the sampler settings are (re)written into it."""
        c = self.cfg
        train_dir, val_dir, _ = self.data_dirs()  # the test split stays unseen
        ae = self.autoencoder()
        ae_record = json.loads((Path(c.work_dir) / "ae" / F.CACHE_FILE).read_text())
        policy_cfg = dataclasses.replace(self.policy_config(), latent_size=ae.latent_shape[1])
        weights = {k: v for k, v in asdict(policy_cfg).items() if k not in SAMPLER_KEYS}
        out = Path(c.work_dir) / POLICY_DIR
        key = F.cache_key(
            train_dir,
            kind="flow_policy",
            ae_key=ae_record["key"],
            policy=weights,
            pretrain=asdict(c.pretrain),
            seed=c.seed,
        )
        record = F.cached(out, key)
        if record is None:
            record = self._pretrain_flow(ae, policy_cfg, train_dir, val_dir, out)
            F.write_cache(out, key, record)
        saved = json.loads((out / CONFIG_FILE).read_text())
        (out / CONFIG_FILE).write_text(json.dumps({**saved, **asdict(c.sampler)}, indent=1))
        metrics = {
            f"pretrain/{k}": float(v)
            for k, v in record.items()
            if k in ("val_loss", "val_mse", "steps")
        }
        metrics["pretrain/ae_psnr"] = float(ae_record["psnr"])
        return out, metrics

    def _pretrain_flow(self, ae, policy_cfg, train_dir: Path, val_dir: Path, out: Path) -> dict:
        from mmrl.models.flow_policy import FlowVelocityPolicy
        from mmrl.worldmodel.flow_pretrain import pretrain_flow_policy

        last = self._fit_policy(
            FlowVelocityPolicy, policy_cfg, pretrain_flow_policy, ae, train_dir, val_dir, out
        )
        steps = self.cfg.pretrain.steps
        return {"steps": steps, "val_loss": last["val/loss"], "val_mse": last["val/mse"]}


__all__ = ["WorldModelFlowConfig", "WorldModelFlowTask"]
