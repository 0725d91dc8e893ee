"""The rollout interface every engine implements, and the engine registry."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from mmrl.protocol import Batch
from mmrl.sampling import SamplingParams
from mmrl.utils.registry import Registry


class RolloutEngine(Protocol):
    """A generation backend. Engines are built as
    ``engine_cls(model=actor_module, family=PolicyFamily, tokenizer=tokenizer, model_path=path,
    cfg=RolloutConfig, max_model_len=prompt + response length)`` and may ignore what they do
    not need; what depends on the model kind they ask the family.
    """

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Load the actor's current weights into the engine (after each update)."""
        ...

    def generate(self, prompts: Batch, sampling: SamplingParams) -> Batch:
        """Generate one response per row of ``prompts``.

        ``prompts`` holds left-padded ``input_ids``, ``attention_mask`` and
        ``position_ids`` [B, P]. The result adds ``responses`` [B, T] (right-padded),
        ``response_mask`` [B, T] (1 up to and including EOS), ``rollout_log_probs``
        [B, T], and extends ``input_ids``/``attention_mask``/``position_ids`` to
        [B, P + T]. ``meta["num_clipped"]`` counts responses that hit
        ``max_tokens`` without EOS; the per-sample flag is ``response_clipped`` [B].
        """
        ...


ROLLOUT_ENGINES: Registry[Callable[..., RolloutEngine]] = Registry(
    "rollout engine", "actor_rollout_ref.rollout.name"
)
# vLLM is slow to import: imported only when a run asks for it.
ROLLOUT_ENGINES.add("vllm", "mmrl.rollout.vllm:VLLMRollout")


def register_rollout(name: str, **traits: object) -> Callable:
    """Register an engine class (or factory) under the name ``rollout.name`` uses."""
    return ROLLOUT_ENGINES.register(name, **traits)


def get_rollout(name: str) -> Callable[..., RolloutEngine]:
    """The engine class ``name`` names (imported on first use); ConfigError lists the known
    ones."""
    return ROLLOUT_ENGINES.get(name)
