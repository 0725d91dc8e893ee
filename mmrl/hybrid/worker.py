"""The hybrid worker: actor, rollout and reference colocated on one data-parallel rank.

Each instance lives in one process that has joined the default process group
(:func:`mmrl.hybrid.fsdp.init_process_group`) and trains its FSDP2 shard. The
embedded mode runs one instance in the trainer's process (a one-rank group); the
Ray mode runs one per Ray actor. Worker groups call the methods marked with
``@register`` on every rank (see :mod:`mmrl.hybrid.dispatch`).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist

from mmrl.config import RolloutConfig, RunConfig
from mmrl.hybrid import actor as actor_fns
from mmrl.hybrid import critic as critic_fns
from mmrl.hybrid import fsdp
from mmrl.hybrid import state as train_state
from mmrl.hybrid.dispatch import Dispatch, register
from mmrl.models import policy_family
from mmrl.models.freeze import freeze_modules
from mmrl.protocol import Batch
from mmrl.rollout import get_rollout
from mmrl.sampling import SamplingParams

log = logging.getLogger(__name__)
# Rank r samples with seed + r * RANK_SEED_STRIDE: ranks draw independent noise, and
# rank 0 keeps the configured seed, so one worker reproduces the embedded run. Token engines
# prefer the rows' own seeds (sample_seeds), which make a response independent of its rank.
RANK_SEED_STRIDE = 1_000_003


def local_mini_batch_size(global_size: int, world_size: int, key: str) -> int:
    """Samples per optimizer step on one rank; every rank takes an equal share."""
    if global_size % world_size:
        raise ValueError(
            f"{key} gives {global_size} samples per optimizer step, which does not split "
            f"evenly over {world_size} data-parallel workers"
        )
    return global_size // world_size


def warmup(steps: int) -> Callable[[int], float]:
    """The lr multiplier at RL step ``step`` (from 0): ``(step + 1) / steps`` up to 1."""
    if steps < 0:
        raise ValueError(f"actor.lr_warmup_steps must be >= 0, found {steps}")
    return lambda step: min(1.0, (step + 1) / steps) if steps else 1.0


# A compiled vLLM model costs 17-35 s more start-up on CPU. It sampled 19-30% faster in GRPO
# steps at 10.6M and 85M in bf16 and at 85M in fp32, 0.15-1 s a step, paying back after about
# 35-230 steps; at 10.6M in fp32 on an AVX2-only CPU the step was 5% slower (docs/scaling.md).
COMPILE_MIN_STEPS = 200


def rollout_config(cfg: RolloutConfig, precision: str, total_steps: int) -> RolloutConfig:
    """The engine settings a run of ``total_steps`` uses.

    ``rollout.dtype=auto`` is the dtype the actor computes in: bfloat16 under the bf16
    mixed-precision policy (its parameters stay fp32), else the parameters' own.
    ``rollout.enforce_eager=null`` compiles the vLLM model for runs of at least
    :data:`COMPILE_MIN_STEPS` steps and runs it eagerly for shorter ones.
    """
    if cfg.dtype == "auto" and precision == "bf16":
        cfg = dataclasses.replace(cfg, dtype="bfloat16")
    if cfg.enforce_eager is None:
        cfg = dataclasses.replace(cfg, enforce_eager=total_steps < COMPILE_MIN_STEPS)
    return cfg


class ActorRolloutRefWorker:
    """The trainable actor (FSDP2), its sharded optimizer, a frozen reference and the rollout
    engine.
    """

    def __init__(self, cfg: RunConfig, model_path: str | Path, need_ref: bool) -> None:
        self.cfg = cfg
        arr = cfg.actor_rollout_ref
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.device = fsdp.device()
        self.model_path = Path(model_path)
        # Chosen once from the checkpoint's files; everything kind-specific goes through it.
        self.family = policy_family(model_path)
        self.precision = fsdp.resolve_precision(
            cfg.trainer.mixed_precision, self.device.type, self.family.auto_bf16
        )
        mp_policy = fsdp.mixed_precision_policy(self.precision, self.device.type)
        if self.rank == 0:
            log.info(
                "the actor computes in %s (trainer.mixed_precision=%s)",
                self.precision,
                cfg.trainer.mixed_precision,
            )
        model = self.family.load(self.model_path, arr.model.dtype).to(self.device)
        self.tokenizer = self.family.load_tokenizer(self.model_path)
        ref = copy.deepcopy(model).eval().requires_grad_(False) if need_ref else None
        freeze_modules(model, arr.actor.freeze_modules)
        self.model = fsdp.shard_model(model, mp_policy)
        self.ref_model = fsdp.shard_model(ref, mp_policy) if ref is not None else None
        # Built over the sharded parameters, so each rank holds only its shard of Adam's state.
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=arr.actor.lr,
            weight_decay=arr.actor.weight_decay,
            fused=arr.actor.fused_optimizer or None,  # None: torch's own choice per device
        )
        self.lr_schedule = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, warmup(arr.actor.lr_warmup_steps)
        )
        self.mini_batch_size = local_mini_batch_size(
            arr.actor.ppo_mini_batch_size * arr.rollout.n,
            self.world_size,
            "actor_rollout_ref.actor.ppo_mini_batch_size * rollout.n",
        )
        engine_cfg = rollout_config(arr.rollout, self.precision, cfg.trainer.total_steps)
        if self.rank == 0 and arr.rollout.name == "vllm" and arr.rollout.enforce_eager is None:
            log.info(
                "the vLLM engine runs %s (rollout.enforce_eager=null: compiled for runs of %d "
                "steps or more; this run has %d)",
                "eagerly" if engine_cfg.enforce_eager else "compiled",
                COMPILE_MIN_STEPS,
                cfg.trainer.total_steps,
            )
        self.rollout = get_rollout(arr.rollout.name)(
            model=self.model,
            family=self.family,
            tokenizer=self.tokenizer,
            model_path=str(model_path),
            cfg=engine_cfg,
            max_model_len=cfg.data.max_prompt_length + cfg.data.max_response_length,
        )
        # An engine that keeps the actor's own module (transformers) generates with it
        # under the gathered full weights; one with its own copy (vLLM) gets them by sync.
        self.engine_shares_module = any(v is self.model for v in vars(self.rollout).values())

    @register(Dispatch.DP_COMPUTE)
    def generate_sequences(self, prompts: Batch, sampling: SamplingParams) -> Batch:
        """Responses for this rank's prompts; see :class:`mmrl.rollout.base.RolloutEngine`."""
        if sampling.seed is not None:
            sampling = dataclasses.replace(
                sampling, seed=sampling.seed + RANK_SEED_STRIDE * self.rank
            )
        view = fsdp.full_weights(self.model) if self.engine_shares_module else nullcontext()
        with view:
            out = self.rollout.generate(prompts.to(self.device), sampling)
        return out.to("cpu")

    @register(Dispatch.DP_COMPUTE)
    def compute_log_prob(self, batch: Batch) -> torch.Tensor:
        """Log-probs [b, T] of the responses under the current actor."""
        rollout = self.cfg.actor_rollout_ref.rollout
        return actor_fns.compute_log_probs(
            self.family,
            self.model,
            batch.to(self.device),
            rollout.log_prob_micro_batch_size,
            rollout.temperature,
            trim=self.cfg.actor_rollout_ref.model.trim_padding,
            max_tokens=self._log_prob_max_tokens(),
            pack=self.cfg.actor_rollout_ref.model.remove_padding,
            share_prompts=self.cfg.actor_rollout_ref.model.share_prompts,
        ).cpu()

    @register(Dispatch.DP_COMPUTE)
    def compute_ref_log_prob(self, batch: Batch) -> torch.Tensor:
        """Log-probs [b, T] of the responses under the frozen reference policy."""
        if self.ref_model is None:
            raise RuntimeError("the reference policy was not built; enable a KL loss or KL reward")
        arr = self.cfg.actor_rollout_ref
        return actor_fns.compute_log_probs(
            self.family,
            self.ref_model,
            batch.to(self.device),
            arr.ref.log_prob_micro_batch_size,
            arr.rollout.temperature,
            trim=arr.model.trim_padding,
            max_tokens=self._log_prob_max_tokens(),
            pack=arr.model.remove_padding,
            share_prompts=arr.model.share_prompts,
        ).cpu()

    def _log_prob_max_tokens(self) -> int | None:
        """The token budget of log-prob micro-batches (actor.use_dynamic_bsz), else None."""
        actor = self.cfg.actor_rollout_ref.actor
        return actor.ppo_max_token_len_per_gpu if actor.use_dynamic_bsz else None

    @register(Dispatch.DP_UPDATE)
    def update_actor(self, batch: Batch, seed: int) -> dict[str, float]:
        """One PPO update on this rank's share of the batch, then the new weights go into the
        rollout engine.
        """
        arr, algo = self.cfg.actor_rollout_ref, self.cfg.algorithm
        metrics = actor_fns.update_policy(
            self.family,
            self.model,
            self.optimizer,
            batch.to(self.device),
            arr.actor,
            mini_batch_size=self.mini_batch_size,
            temperature=arr.rollout.temperature,
            seed=seed,
            trim=arr.model.trim_padding,
            pack=arr.model.remove_padding,
            share_prompts=arr.model.share_prompts,
            rollout_is=(algo.rollout_is, algo.rollout_is_cap) if algo.rollout_is else None,
        )
        self.lr_schedule.step()  # once per RL step, as verl's warm-up counts
        start = time.perf_counter()
        self.sync_rollout_weights()
        metrics["timing_s/update_weights"] = time.perf_counter() - start
        return metrics

    @register(Dispatch.ALL)
    def sync_rollout_weights(self) -> None:
        """Gather the full weights from the shards and load them into this rank's engine."""
        if self.engine_shares_module:
            self.rollout.sync_weights(self.model)  # it reads the module itself: nothing to move
            return
        state = fsdp.full_state_dict(self.model, on_every_rank=True)
        self.rollout.sync_weights(state.items())

    @register(Dispatch.ALL)
    def save_pretrained(self, path: str | Path) -> Path:
        """Write the actor as a folder its family loads (for a transformers model, one vLLM
        serves too); rank 0 writes."""
        path = Path(path)
        state = fsdp.full_state_dict(self.model, on_every_rank=False)
        if self.rank == 0:
            self.family.save(self.model, path, state, source=self.model_path)
        return path

    @register(Dispatch.ALL)
    def save_checkpoint(self, folder: str | Path) -> None:
        """``folder/actor`` (as :meth:`save_pretrained`) and ``folder/actor_optim`` (optimizer
        and lr schedule, gathered); rank 0 writes."""
        folder = Path(folder)
        self.save_pretrained(folder / "actor")
        train_state.save_optimizer(
            self.model, self.optimizer, self.lr_schedule, folder / "actor_optim"
        )

    @register(Dispatch.ALL)
    def load_checkpoint(self, folder: str | Path) -> None:
        """Continue from what :meth:`save_checkpoint` wrote, at any number of ranks; the
        rollout engine gets the loaded weights."""
        folder = Path(folder)
        # Read by the family, as the folder was first loaded: the same names and dtypes.
        saved = self.family.load(folder / "actor", self.cfg.actor_rollout_ref.model.dtype)
        train_state.load_model_weights(self.model, saved.state_dict())
        train_state.load_optimizer(
            self.model, self.optimizer, self.lr_schedule, folder / "actor_optim"
        )
        self.sync_rollout_weights()

    @register(Dispatch.ALL)
    def pid(self) -> int:
        """This rank's process id (fault-recovery tests kill it)."""
        return os.getpid()

    @register(Dispatch.ALL)
    def rng_state(self) -> dict:
        """This rank's Python, numpy and torch RNG states (JSON-able)."""
        return train_state.rng_state()

    @register(Dispatch.ALL)
    def set_rng_state(self, states: list[dict]) -> None:
        """Restore this rank's entry of ``states`` (one per rank that saved them); at another
        number of ranks, the states of the saving ranks are reused in turn."""
        train_state.set_rng_state(states[self.rank % len(states)])

    @register(Dispatch.ALL)
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """A copy of the actor's full weights on rank 0's CPU; ``{}`` on the other ranks."""
        # With one rank the gathered tensors can share storage with the live parameters.
        return {
            k: v.clone() for k, v in fsdp.full_state_dict(self.model, on_every_rank=False).items()
        }

    @register(Dispatch.ALL)
    def full_grads(self) -> dict[str, torch.Tensor]:
        """The last optimizer step's full gradient on rank 0's CPU; ``{}`` on the others."""
        return fsdp.full_grads(self.model)

    @register(Dispatch.ALL)
    def memory_stats(self) -> dict[str, float]:
        return fsdp.memory_stats()


class CriticWorker:
    """A value model initialised from the actor's weights with a fresh scalar head (built by the
    policy's family), trained with FSDP2.
    """

    def __init__(self, cfg: RunConfig, model_path: str | Path) -> None:
        self.cfg = cfg.critic
        self.device = fsdp.device()
        self.family = policy_family(model_path)
        mp_policy = fsdp.mixed_precision_policy(
            cfg.trainer.mixed_precision, self.device.type, self.family.auto_bf16
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.trainer.seed)  # every rank draws the same fresh value head
            model = self.family.load_critic(Path(model_path)).to(self.device)
        self.model = fsdp.shard_model(model, mp_policy)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.cfg.lr)
        self.mini_batch_size = local_mini_batch_size(
            cfg.actor_rollout_ref.actor.ppo_mini_batch_size * cfg.actor_rollout_ref.rollout.n,
            dist.get_world_size(),
            "actor_rollout_ref.actor.ppo_mini_batch_size * rollout.n",
        )

    @register(Dispatch.ALL)
    def save_checkpoint(self, folder: str | Path) -> None:
        """``folder/critic``: the gathered weights and optimizer state; rank 0 writes."""
        folder = Path(folder) / "critic"
        weights = fsdp.full_state_dict(self.model, on_every_rank=False)
        if dist.get_rank() == 0:
            train_state.save_model_weights(weights, folder / train_state.MODEL_FILE)
        train_state.save_optimizer(self.model, self.optimizer, None, folder)

    @register(Dispatch.ALL)
    def load_checkpoint(self, folder: str | Path) -> None:
        folder = Path(folder) / "critic"
        weights = train_state.read_weights(folder / train_state.MODEL_FILE)
        train_state.load_model_weights(self.model, weights)
        train_state.load_optimizer(self.model, self.optimizer, None, folder)

    @register(Dispatch.DP_COMPUTE)
    def compute_values(self, batch: Batch) -> torch.Tensor:
        """Values [b, T] of the response steps."""
        return critic_fns.compute_values(
            self.family, self.model, batch.to(self.device), self.cfg.ppo_micro_batch_size
        ).cpu()

    @register(Dispatch.DP_UPDATE)
    def update_critic(self, batch: Batch, seed: int) -> dict[str, float]:
        return critic_fns.update_critic(
            self.family,
            self.model,
            self.optimizer,
            batch.to(self.device),
            self.cfg,
            self.mini_batch_size,
            seed,
        )

    @register(Dispatch.ALL)
    def full_grads(self) -> dict[str, torch.Tensor]:
        """The last optimizer step's full gradient on rank 0's CPU; ``{}`` on the others."""
        return fsdp.full_grads(self.model)

    @register(Dispatch.ALL)
    def memory_stats(self) -> dict[str, float]:
        return fsdp.memory_stats()
