"""Saving a run's whole state at a step and continuing from it exactly.

:func:`find_checkpoint` decides where a run continues from (``trainer.resume_mode``) and
refuses a config that changed in a way the checkpoint cannot honour. :func:`save` writes
a checkpoint (:mod:`mmrl.trainer.checkpoint` for the folder and its atomicity);
:func:`restore` puts it back into fresh workers, the prompt loader, the KL controller and
every RNG, so the next step is the step the interrupted run would have taken.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from mmrl.config import RunConfig
from mmrl.errors import ConfigError
from mmrl.hybrid import Workers
from mmrl.hybrid.state import rng_state, set_rng_state
from mmrl.tasks import Task
from mmrl.trainer import checkpoint as ckpt
from mmrl.trainer.guard import InvalidRateMonitor
from mmrl.verifiers import VerifierRunner

log = logging.getLogger(__name__)

# Keys a resumed run may change: how long it runs, where and on how many workers, what it
# logs and saves. Anything else changes the experiment, so resuming with it is refused.
RESUMABLE_KEYS = (
    "trainer.total_steps",
    "trainer.loggers",
    "trainer.progress_bar",
    "trainer.test_freq",
    "trainer.save_freq",
    "trainer.resume_mode",
    "trainer.resume_from_path",
    "trainer.max_actor_ckpt_to_keep",
    "trainer.max_restarts",
    "trainer.output_dir",
    "trainer.experiment_name",
    "trainer.n_workers_per_node",
    "trainer.nnodes",
    "trainer.ray_address",
    "trainer.ray_object_store_mb",
    "trainer.ray_num_cpus_per_worker",
    "trainer.dist_timeout_s",
    "reward.num_workers",
    "reward.timeout_s",
)


@dataclasses.dataclass
class RunState:
    """What the fit loop carries from step to step besides the workers."""

    loader: Any  # fit.PromptLoader: state_dict() / load_state_dict()
    kl_ctrl: Any
    monitor: InvalidRateMonitor
    runner: VerifierRunner


def config_record(cfg: RunConfig) -> dict[str, Any]:
    """The config as plain data (what ``config.json`` holds)."""
    return OmegaConf.to_container(OmegaConf.structured(cfg), enum_to_str=True)


def find_checkpoint(cfg: RunConfig) -> Path | None:
    """The checkpoint this run continues from, or None to start at step 1.

    ``resume_mode=auto`` takes ``output_dir``'s latest; ``resume_path`` takes
    ``resume_from_path``; ``disable`` starts over (and forgets the folder's old "latest").
    A checkpoint whose config differs in a key outside :data:`RESUMABLE_KEYS` is refused.
    """
    t = cfg.trainer
    if t.resume_mode == "disable":
        (cfg.output_dir / ckpt.LATEST_FILE).unlink(missing_ok=True)
        return None
    if t.resume_mode == "resume_path":
        if not t.resume_from_path:
            raise ConfigError(
                "trainer.resume_mode=resume_path needs trainer.resume_from_path",
                fix="set trainer.resume_from_path=<run>/global_step_N, or resume_mode=auto",
            )
        folder = Path(t.resume_from_path)
        ckpt.checkpoint_step(folder)
        ckpt.check_complete(folder)
    else:
        folder = ckpt.latest_checkpoint(cfg.output_dir)
        if folder is None:
            return None
    check_config(ckpt.read_json(folder / ckpt.CONFIG_FILE), config_record(cfg), folder)
    return folder


def check_config(saved: dict, current: dict, folder: Path) -> None:
    """Refuse ``current`` if it changes a key that a resumed run must keep, naming the key."""
    before, after = _flatten(saved), _flatten(current)
    changed = [
        f"{key}: {before[key]!r} in {folder.name}, {after[key]!r} now"
        for key in sorted(before.keys() & after.keys())
        if before[key] != after[key] and key not in RESUMABLE_KEYS
    ]
    if changed:
        raise ConfigError(
            f"cannot resume from {folder} with a changed config: {'; '.join(changed)}",
            fix="resume with the checkpoint's values, or start over with trainer.resume_mode="
            f"disable; keys that may change: {', '.join(RESUMABLE_KEYS)}",
        )


def save(
    cfg: RunConfig,
    step: int,
    workers: Workers,
    state: RunState,
    model_path: Path,
    task: Task,
    metrics: dict[str, float],
) -> Path:
    """Write checkpoint ``global_step_<step>`` atomically and prune old ones."""

    def write(folder: Path) -> None:
        workers.actor.save_checkpoint(folder)
        task.complete_checkpoint(Path(model_path), folder / "actor")
        if workers.critic is not None:
            workers.critic.save_checkpoint(folder)
        record = {
            "step": step,
            "model_path": str(model_path),
            "world_size": workers.actor.world_size,
            "loader": state.loader.state_dict(),
            "kl_ctrl": dict(vars(state.kl_ctrl)),
            "invalid_rate_streak": state.monitor.streak,
            "verifier_error_examples": [[*k, v] for k, v in state.runner.error_examples.items()],
            "rng": {"trainer": rng_state(), "workers": workers.actor.rng_state()},
            "metrics": {k: v if isinstance(v, int | str) else float(v) for k, v in metrics.items()},
        }
        (folder / ckpt.STATE_FILE).write_text(json.dumps(record))
        (folder / ckpt.CONFIG_FILE).write_text(json.dumps(config_record(cfg), indent=1))

    folder = ckpt.save_atomically(cfg.output_dir, step, write)
    for gone in ckpt.prune(cfg.output_dir, cfg.trainer.max_actor_ckpt_to_keep):
        log.info("removed %s (trainer.max_actor_ckpt_to_keep)", gone)
    return folder


def restore(folder: Path, workers: Workers, state: RunState) -> dict[str, Any]:
    """Load checkpoint ``folder`` into fresh workers and the run's state; returns the saved
    record (``step``, ``metrics``, ...)."""
    record = ckpt.read_json(folder / ckpt.STATE_FILE)
    workers.actor.load_checkpoint(folder)
    if workers.critic is not None:
        workers.critic.load_checkpoint(folder)
    state.loader.load_state_dict(record["loader"])
    for key, value in record["kl_ctrl"].items():
        setattr(state.kl_ctrl, key, value)
    state.monitor.streak = record["invalid_rate_streak"]
    state.runner.error_examples = {
        (name, kind): message for name, kind, message in record["verifier_error_examples"]
    }
    set_rng_state(record["rng"]["trainer"])
    workers.actor.set_rng_state(record["rng"]["workers"])
    log.info("resumed from %s (step %d)", folder, record["step"])
    return record


def snapshot(state: RunState) -> dict[str, Any]:
    """The trainer-side state in memory (loader, KL controller, streak, RNG), for
    :func:`rewind`."""
    return {
        "loader": state.loader.state_dict(),
        "kl_ctrl": dict(vars(state.kl_ctrl)),
        "streak": state.monitor.streak,
        "rng": rng_state(),
    }


def rewind(state: RunState, saved: dict[str, Any]) -> None:
    """Put back what :func:`snapshot` took (a restart before any checkpoint)."""
    state.loader.load_state_dict(saved["loader"])
    for key, value in saved["kl_ctrl"].items():
        setattr(state.kl_ctrl, key, value)
    state.monitor.streak = saved["streak"]
    set_rng_state(saved["rng"])


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out
    return {prefix.rstrip("."): tree}
