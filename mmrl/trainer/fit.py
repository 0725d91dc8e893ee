"""The fit loop: one function per stage, in the data-flow order of docs/architecture.md.

generate -> score -> old/ref log-probs -> KL -> advantages -> update -> metrics
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
import warnings
from contextlib import closing
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf
from tqdm.auto import tqdm

from mmrl import algos
from mmrl.config import RunConfig
from mmrl.errors import CheckpointError, ConfigError
from mmrl.hybrid import WorkerError, WorkerGroup, Workers, build_workers
from mmrl.hybrid.minibatch import minibatch_layout
from mmrl.processors.base import PromptProcessor
from mmrl.protocol import Batch
from mmrl.tasks import Task, get_task
from mmrl.trainer import resume
from mmrl.trainer.checkpoint import checkpoint_step, kill_point
from mmrl.trainer.doctor import LiveDoctor
from mmrl.trainer.experience import (
    make_experience,
    needs_critic,
    needs_reference,
    step_seed,
)
from mmrl.trainer.faults import FaultRecovery, kill_worker_point
from mmrl.trainer.guard import InvalidRateMonitor, batch_for_update
from mmrl.trainer.metrics import compute_data_metrics, memory_metrics, prompt_set_metrics
from mmrl.trainer.preflight import preflight
from mmrl.trainer.report import CONFIG_FILE, METRICS_FILE, write_report
from mmrl.trainer.samples import SampleLog
from mmrl.trainer.tracking import Tracker
from mmrl.trainer.validation import build_val_runner, validate_all
from mmrl.utils.resources import process_tree_stats
from mmrl.utils.seed import set_seed
from mmrl.utils.timing import peak_rss_gib, timer
from mmrl.verifiers import VerifierRunner

log = logging.getLogger(__name__)


@dataclass
class RunResult:
    output_dir: Path
    history: list[dict] = field(default_factory=list)
    wall_time_s: float = 0.0
    peak_memory_gib: float = 0.0
    summary: dict = field(default_factory=dict)  # what summary.json holds

    def series(self, key: str) -> list[float]:
        """The logged values of one metric, in step order (steps that lack it are skipped)."""
        return [row[key] for row in self.history if row.get(key) is not None]


class PromptLoader:
    """Endless, seeded iteration over encoded prompts in batches of ``batch_size``."""

    def __init__(self, prompts: Batch, batch_size: int, shuffle: bool, seed: int) -> None:
        if batch_size > len(prompts):
            raise ConfigError(
                f"data.train_batch_size={batch_size} is larger than the training set "
                f"({len(prompts)} prompts)"
            )
        self.prompts, self.batch_size, self.shuffle = prompts, batch_size, shuffle
        self.rng = np.random.default_rng(seed)
        self.order, self.pos = self._new_order(), 0

    def _new_order(self) -> np.ndarray:
        n = len(self.prompts)
        return self.rng.permutation(n) if self.shuffle else np.arange(n)

    def next(self) -> Batch:
        if self.pos + self.batch_size > len(self.order):
            self.order, self.pos = self._new_order(), 0
        idx = self.order[self.pos : self.pos + self.batch_size]
        self.pos += self.batch_size
        return self.prompts[torch.from_numpy(idx)]

    def state_dict(self) -> dict:
        """The pass's order, the position in it and the shuffle RNG (JSON-able)."""
        return {"order": self.order.tolist(), "pos": self.pos, "rng": self.rng.bit_generator.state}

    def load_state_dict(self, state: dict) -> None:
        if len(state["order"]) != len(self.prompts):
            raise CheckpointError(
                f"the checkpoint's prompt order covers {len(state['order'])} prompts, the "
                f"training set has {len(self.prompts)}",
                fix="resume with the data the checkpoint was trained on",
            )
        self.order, self.pos = np.asarray(state["order"], dtype=np.int64), state["pos"]
        self.rng.bit_generator.state = state["rng"]


def prepare_initial_model(cfg: RunConfig, task: Task) -> tuple[Path, dict[str, float]]:
    """Return a local checkpoint folder to start RL from, with metrics to log at step 0.

    With ``actor_rollout_ref.model.path`` set, that folder is used as is; otherwise the
    task makes its starting point (:meth:`Task.initial_model`: for example a model built
    from config and warmed up with SFT under ``<output_dir>/init_model``).
    """
    if cfg.actor_rollout_ref.model.path:
        return Path(cfg.actor_rollout_ref.model.path), {}
    return task.initial_model(cfg)


def rl_step(
    cfg: RunConfig,
    step: int,
    prompts: Batch,
    worker: WorkerGroup,
    critic: WorkerGroup | None,
    processor: PromptProcessor,
    kl_ctrl,
    runner: VerifierRunner,
) -> dict[str, float]:
    metrics: dict[str, float] = {}
    seed = step_seed(cfg, step)
    with timer("step", metrics):
        batch = make_experience(
            cfg, step, prompts, worker, critic, processor, kl_ctrl, runner, metrics
        )
        update, guard_metrics = batch_for_update(batch, cfg.trainer.skip_zero_variance_updates)
        metrics.update(guard_metrics)
        if update is None:  # nothing to learn from: no optimizer step, the lr schedule waits
            log.warning(
                "step %d: no sample is left to learn from (reward/invalid_rate=%.2f); the "
                "update is skipped",
                step,
                metrics.get("reward/invalid_rate", 0.0),
            )
        else:
            mini = cfg.actor_rollout_ref.actor.ppo_mini_batch_size * cfg.actor_rollout_ref.rollout.n
            update.reorder(minibatch_layout(len(update), mini, worker.world_size, seed))
            if critic is not None:
                with timer("update_critic", metrics):
                    metrics.update(critic.update_critic(update.clone(), seed=seed))
            with timer("update_actor", metrics):
                metrics.update(worker.update_actor(update, seed=seed))
    metrics.update(compute_data_metrics(batch, metrics["timing_s/step"], metrics["timing_s/gen"]))
    return metrics


def fit(cfg: RunConfig) -> RunResult:
    """Run RL training as configured and return the logged history.

    However the run ends, ``<output_dir>/report.html`` is written last (a crashed run's report
    says why it stopped).
    """
    trackers: list[Tracker] = []  # train() puts its tracker here, for the report
    error = None
    try:
        return train(cfg, trackers)
    except BaseException as err:
        error = f"{type(err).__name__}: {err}"
        raise
    finally:
        history = trackers[0].history if trackers else None
        if history is not None or (cfg.output_dir / METRICS_FILE).is_file():
            try:
                write_report(cfg.output_dir, history, error, cfg.trainer.doctor)
            except Exception:  # the report never hides the run's own outcome
                log.exception("could not write %s", cfg.output_dir / "report.html")


def train(cfg: RunConfig, trackers: list[Tracker]) -> RunResult:
    """The body of :func:`fit`; appends its tracker to ``trackers`` once it has one."""
    start = time.perf_counter()
    set_seed(cfg.trainer.seed)
    algo, rollout = cfg.algorithm, cfg.actor_rollout_ref.rollout
    preflight(cfg)  # every config problem at once, before any work
    if algos.ADV_ESTIMATORS.trait(algo.adv_estimator, "needs_groups", False) and rollout.n < 2:
        warnings.warn(
            f"algorithm.adv_estimator={algo.adv_estimator} compares the samples of one prompt, but "
            f"actor_rollout_ref.rollout.n={rollout.n}: every group has one sample, so every "
            "advantage "
            "is zero and the policy will not learn. Set rollout.n >= 2.",
            stacklevel=2,
        )
    if algos.ADV_ESTIMATORS.trait(algo.adv_estimator, "needs_components", False) and (
        algo.use_kl_in_reward
    ):
        raise ConfigError(
            f"algorithm.adv_estimator={algo.adv_estimator} normalises each verifier's score, so a "
            "KL penalty in the reward would be dropped: set algorithm.use_kl_in_reward=false and "
            "use actor_rollout_ref.actor.use_kl_loss=true instead"
        )
    task = get_task(cfg.task.get("name", ""))(cfg.task)
    cfg.output_dir.mkdir(parents=True, exist_ok=True)
    (cfg.output_dir / CONFIG_FILE).write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    resume_from = resume.find_checkpoint(cfg)  # a refused config fails here, before any work
    resume_step = checkpoint_step(resume_from) if resume_from is not None else None
    model_path, init_metrics = prepare_initial_model(cfg, task)
    data = task.build_data(cfg.trainer.seed)

    processor = task.build_prompt_processor(model_path, cfg)
    train_prompts = processor.encode_dataset(data.train, "train")
    val_prompts = processor.encode_dataset(data.val, "val")
    kl_ctrl = algos.build_kl_controller(algo.kl_ctrl)
    loader = PromptLoader(
        train_prompts, cfg.data.train_batch_size, cfg.data.shuffle, cfg.trainer.seed
    )
    tracker = Tracker(
        cfg.output_dir,
        cfg.trainer.loggers,
        cfg.trainer.project_name,
        cfg.trainer.experiment_name,
        dataclasses.asdict(cfg),
        resume_step,
    )
    trackers.append(tracker)
    monitor = InvalidRateMonitor(cfg.trainer.max_invalid_rate, cfg.trainer.invalid_rate_patience)
    doctor = LiveDoctor(cfg.trainer.doctor)
    # A VLM's images line up with the validation prompts only when none was filtered out.
    aligned = val_prompts.meta["num_filtered_prompts"] == 0
    samples = SampleLog(
        cfg.output_dir, val_images=getattr(data.val, "images", None) if aligned else None
    )
    init_metrics.update(prompt_set_metrics(train_prompts))

    runner = VerifierRunner.from_config(cfg.reward)
    val_runner = build_val_runner(cfg, runner)  # reward.val_verifiers, or the same runner
    state = resume.RunState(loader, kl_ctrl, monitor, runner)
    initial = resume.snapshot(state)  # where a restart before the first checkpoint begins
    faults = FaultRecovery(cfg.output_dir, cfg.trainer.max_restarts)

    def run_steps(workers: Workers, first: int) -> None:
        worker, critic = workers.actor, workers.critic
        bar = tqdm(
            range(first, cfg.trainer.total_steps + 1),
            desc="rl",
            disable=not cfg.trainer.progress_bar,
        )
        for step in bar:
            workers.set_step(step)  # a worker failure names the step
            metrics = rl_step(cfg, step, loader.next(), worker, critic, processor, kl_ctrl, runner)
            if step == 1 and not cfg.trainer.val_before_train:
                metrics.update(init_metrics)  # no step-0 row: the data and warm-up numbers
            metrics.update(process_tree_stats())  # a leak shows as a rising system/* line
            metrics.update(faults.metrics())
            last, images = step == cfg.trainer.total_steps, {}
            with timer("step", metrics):  # validation and checkpoints count in the step (verl)
                if cfg.trainer.test_freq > 0 and (step % cfg.trainer.test_freq == 0 or last):
                    with timer("testing", metrics):
                        val_metrics, images = validate_all(
                            cfg,
                            val_prompts,
                            worker,
                            processor,
                            val_runner,
                            partial(samples.record, step),
                        )
                        metrics.update(val_metrics)
                stop = monitor.should_stop(metrics)  # before a save: the streak is state too
                freq = cfg.trainer.save_freq
                if stop or (freq > 0 and (step % freq == 0 or last)):
                    with timer("save_checkpoint", metrics):
                        folder = resume.save(cfg, step, workers, state, model_path, task, metrics)
            metrics.update(memory_metrics(workers))
            tracker.log(metrics, step)
            tracker.log_images(images, step)
            doctor.observe(tracker.history)
            kill_point("after_step", step)
            kill_worker_point(step, workers, faults.restarts)
            if "critic/score/mean" in metrics:  # absent when no sample was valid
                bar.set_postfix(score=f"{metrics['critic/score/mean']:.3f}")
            if stop:
                raise monitor.error(metrics, runner.error_examples, str(folder / "actor"))
        worker.save_pretrained(cfg.output_dir / "actor")

    # Closes the loggers' files however the run ends; `with workers` stops worker processes.
    with closing(runner), closing(val_runner), closing(tracker):
        while True:  # once, or again after a worker died (trainer.max_restarts)
            # In-process, or one Ray actor per rank (trainer.n_workers_per_node, nnodes, ...).
            workers = build_workers(
                cfg, model_path, need_ref=needs_reference(cfg), need_critic=needs_critic(cfg)
            )
            try:
                with workers:
                    if resume_from is not None:
                        record = resume.restore(resume_from, workers, state)
                        if not tracker.history or tracker.history[-1]["step"] != resume_step:
                            tracker.log(record["metrics"], resume_step)  # killed before logging
                    elif cfg.trainer.val_before_train:
                        val_metrics, images = validate_all(
                            cfg,
                            val_prompts,
                            workers.actor,
                            processor,
                            val_runner,
                            partial(samples.record, 0),
                        )
                        tracker.log({**init_metrics, **val_metrics}, step=0)
                        tracker.log_images(images, step=0)
                    run_steps(workers, (resume_step or 0) + 1)
                break
            except WorkerError as err:
                resume_from = faults.recover(err, workers.actor.step)
                resume_step = checkpoint_step(resume_from) if resume_from is not None else None
                if resume_from is None:
                    resume.rewind(state, initial)
                tracker.truncate(resume_step if resume_step is not None else -1)
    extra = task.on_fit_end(cfg, model_path, cfg.output_dir / "actor", tracker.history)
    result = RunResult(cfg.output_dir, tracker.history, time.perf_counter() - start, peak_rss_gib())
    summary = {
        "wall_time_s": result.wall_time_s,
        "peak_memory_gib": result.peak_memory_gib,
        "final_actor": str(cfg.output_dir / "actor"),
        "report": str(cfg.output_dir / "report.html"),
        **extra,
    }
    (cfg.output_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    result.summary = summary
    return result
