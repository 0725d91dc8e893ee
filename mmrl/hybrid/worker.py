"""The hybrid worker: actor, rollout and reference colocated on one set of weights.

In the embedded mode the trainer calls this class directly; the Ray mode wraps
the same class in actors, so there is one actor code path.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer

from mmrl.protocol import Batch
from mmrl.rollout import SamplingParams, get_rollout
from mmrl.trainer import actor as actor_fns
from mmrl.trainer import critic as critic_fns
from mmrl.trainer.config import CriticConfig, RunConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_causal_lm(path: str | Path, dtype: str = "float32") -> torch.nn.Module:
    """Load a ``save_pretrained`` directory from local disk only."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"actor_rollout_ref.model.path={str(path)!r} is not a save_pretrained directory "
            "(no config.json there); models are never downloaded"
        )
    if dtype not in DTYPES:
        raise ValueError(f"actor_rollout_ref.model.dtype={dtype!r}; expected one of {sorted(DTYPES)}")
    return AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype], local_files_only=True)


class ActorRolloutRefWorker:
    """Holds the trainable actor, its optimizer, a frozen reference copy and the rollout engine."""

    def __init__(self, cfg: RunConfig, model_path: str | Path, need_ref: bool) -> None:
        self.cfg = cfg
        arr = cfg.actor_rollout_ref
        self.tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
        self.model = load_causal_lm(model_path, arr.model.dtype)
        self.ref_model = copy.deepcopy(self.model).eval().requires_grad_(False) if need_ref else None
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=arr.actor.lr, weight_decay=arr.actor.weight_decay
        )
        engine_cls = get_rollout(arr.rollout.name)
        self.rollout = engine_cls(
            model=self.model,
            tokenizer=self.tokenizer,
            model_path=str(model_path),
            cfg=arr.rollout,
            max_model_len=cfg.data.max_prompt_length + cfg.data.max_response_length,
        )

    def generate_sequences(self, prompts: Batch, sampling: SamplingParams) -> Batch:
        return self.rollout.generate(prompts, sampling)

    def compute_log_prob(self, batch: Batch) -> torch.Tensor:
        rollout = self.cfg.actor_rollout_ref.rollout
        return actor_fns.compute_log_probs(
            self.model, batch, rollout.log_prob_micro_batch_size, rollout.temperature
        )

    def compute_ref_log_prob(self, batch: Batch) -> torch.Tensor:
        if self.ref_model is None:
            raise RuntimeError("the reference policy was not built; enable a KL loss or KL reward")
        arr = self.cfg.actor_rollout_ref
        return actor_fns.compute_log_probs(
            self.ref_model, batch, arr.ref.log_prob_micro_batch_size, arr.rollout.temperature
        )

    def update_actor(self, batch: Batch, seed: int) -> dict[str, float]:
        """One PPO update, then the new weights go into the rollout engine."""
        arr = self.cfg.actor_rollout_ref
        metrics = actor_fns.update_policy(
            self.model,
            self.optimizer,
            batch,
            arr.actor,
            mini_batch_size=arr.actor.ppo_mini_batch_size * arr.rollout.n,
            temperature=arr.rollout.temperature,
            seed=seed,
        )
        start = time.perf_counter()
        self.rollout.sync_weights(self.model)
        metrics["timing_s/update_weights"] = time.perf_counter() - start
        return metrics

    def save_pretrained(self, path: str | Path) -> Path:
        """Write the actor as a directory that transformers (and vLLM) can load."""
        path = Path(path)
        self.model.save_pretrained(path, safe_serialization=True)
        self.tokenizer.save_pretrained(path)
        return path


class CriticWorker:
    """A value model initialised from the actor's weights with a fresh scalar head."""

    def __init__(self, cfg: CriticConfig, model_path: str | Path, mini_batch_size: int) -> None:
        self.cfg = cfg
        self.mini_batch_size = mini_batch_size
        self.model = AutoModelForTokenClassification.from_pretrained(
            model_path, num_labels=1, local_files_only=True
        )
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr)

    def compute_values(self, batch: Batch) -> torch.Tensor:
        return critic_fns.compute_values(self.model, batch, self.cfg.ppo_micro_batch_size)

    def update_critic(self, batch: Batch, seed: int) -> dict[str, float]:
        return critic_fns.update_critic(self.model, self.optimizer, batch, self.cfg, self.mini_batch_size, seed)
