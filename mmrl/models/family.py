"""Policy families: one per model kind, chosen once from a checkpoint's files.

A family is everything the rest of mmrl may need to know about a kind of policy:
how to load and save it, how to score a rollout's steps (``response_log_probs``),
how to sample from it on its own module (``generate``), whether it has a critic,
and what a vLLM engine needs to serve it. The worker picks the family with
:func:`policy_family` and hands it to the actor update and the rollout engine, so
nothing else asks whether a model is a VLM or a latent policy.

Adding a model kind (for example a flow-matching latent policy) is one subclass of
:class:`PolicyFamily` and one ``@register_family`` line; docs/architecture.md walks
through it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from mmrl.errors import CheckpointError, ConfigError
from mmrl.protocol import Batch
from mmrl.sampling import SamplingParams
from mmrl.utils.registry import Registry

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of ``actor_rollout_ref.model.dtype``."""
    if name not in DTYPES:
        raise ConfigError(
            f"actor_rollout_ref.model.dtype={name!r}; expected one of {sorted(DTYPES)}"
        )
    return DTYPES[name]


@dataclass(frozen=True)
class VLLMServing:
    """What a vLLM engine needs to know about a family's prompts and vocabulary.

    ``placeholder_ids``: media placeholder tokens (one per image/video in a request,
    expanded by vLLM's processor). ``suppressed_token_ids``: ids a response must never
    contain. ``multimodal``: requests may carry images/video (their encoder cache is
    reset after each weight sync).
    """

    placeholder_ids: tuple[int, ...] = ()
    suppressed_token_ids: tuple[int, ...] = ()
    multimodal: bool = False


class PolicyFamily:
    """One model kind. Subclasses override what differs; every method has one caller path.

    ``name`` is the registry name; ``has_critic`` says whether :meth:`load_critic` can
    build a value model for GAE; ``vllm_servable`` whether :meth:`vllm_serving` can serve
    the kind, and ``module_rollout`` the engine that samples it on its own module instead.
    ``auto_bf16`` says whether ``trainer.mixed_precision=auto`` may compute it in bf16, and
    ``packs_rows`` whether :meth:`packed_response_log_probs` can run its rows without padding.
    """

    name: ClassVar[str]
    has_critic: ClassVar[bool] = False
    auto_bf16: ClassVar[bool] = True
    packs_rows: ClassVar[bool] = False
    vllm_servable: ClassVar[bool] = False
    module_rollout: ClassVar[str] = "hf"

    def detect(self, path: Path) -> bool:
        """Whether the folder ``path`` holds a checkpoint of this kind (its files only)."""
        raise NotImplementedError

    def describe(self) -> str:
        """What a folder of this kind holds, for the error on an unknown folder."""
        raise NotImplementedError

    def load(self, path: Path, dtype: str = "float32") -> nn.Module:
        """The policy from local disk; nothing is downloaded."""
        raise NotImplementedError

    def load_tokenizer(self, path: Path) -> Any | None:
        """The tokenizer that maps text to the policy's steps; ``None`` when steps are not
        tokens."""
        return None

    def save(
        self, model: nn.Module, path: Path, state_dict: dict[str, torch.Tensor], source: Path
    ) -> None:
        """Write ``state_dict`` (the gathered weights of ``model``) as a folder this family
        loads, with the files that travel with the weights copied from ``source``."""
        raise NotImplementedError

    def response_log_probs(
        self,
        model: nn.Module,
        batch: Batch,
        temperature: float = 1.0,
        with_entropy: bool = False,
        entropy_grad: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs [b, T] of the batch's response steps (and entropies [b, T]) under
        ``model``, for the distribution the rollout sampled from at ``temperature``.
        ``entropy_grad=False``: the entropies may be detached (nothing differentiates them)."""
        raise NotImplementedError

    def packed_response_log_probs(
        self,
        model: nn.Module,
        batch: Batch,
        temperature: float = 1.0,
        with_entropy: bool = False,
        entropy_grad: bool = True,
        share_prompts: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """:meth:`response_log_probs` with the rows packed end to end, without padding
        (``actor_rollout_ref.model.remove_padding``); ``None`` where this batch cannot be
        packed. With ``share_prompts``, rows with the same prompt may run it once
        (:mod:`mmrl.models.prompt_sharing`). Only a family with ``packs_rows`` is asked."""
        return None

    def trim_padding(self, batch: Batch) -> Batch:
        """``batch`` without the padding steps no row uses (:mod:`mmrl.models.padding`), whose
        :meth:`response_log_probs` equal the first steps of the full batch's. A family whose
        batches have no padding returns it as it is."""
        return batch

    def generate(
        self, model: nn.Module, prompts: Batch, sampling: SamplingParams, tokenizer: Any | None
    ) -> Batch:
        """One response per prompt row sampled on ``model`` itself; see
        :class:`mmrl.rollout.base.RolloutEngine` for the fields it adds."""
        raise NotImplementedError

    def load_critic(self, path: Path) -> nn.Module:
        """A value model initialised from the policy's weights (GAE)."""
        raise ConfigError(
            f"a {self.name} policy has no critic: algorithm.adv_estimator=gae needs one; "
            "choose a critic-free estimator (grpo, rloo, reinforce_plus_plus, remax)"
        )

    def values(self, critic: nn.Module, batch: Batch) -> torch.Tensor:
        """Values [b, T] of the response steps (the state before each step)."""
        raise NotImplementedError

    def vllm_serving(self, path: Path, tokenizer: Any) -> VLLMServing:
        """What a vLLM engine must do to serve this kind."""
        raise ConfigError(self.vllm_refusal())

    def vllm_refusal(self) -> str:
        """Why vLLM cannot serve this kind, and which engine to use (one line)."""
        return (
            f"a {self.name} policy cannot be served by vLLM: set "
            f"actor_rollout_ref.rollout.name={self.module_rollout}"
        )


FAMILIES: Registry[PolicyFamily] = Registry("policy family")


def register_family(name: str) -> Callable[[type[PolicyFamily]], type[PolicyFamily]]:
    """Class decorator: register one instance of the family under ``name``."""

    def wrap(cls: type[PolicyFamily]) -> type[PolicyFamily]:
        cls.name = name
        FAMILIES.add(name, cls())
        return cls

    return wrap


def get_family(name: str) -> PolicyFamily:
    """The registered family ``name``; ConfigError lists the known ones."""
    return FAMILIES.get(name)


def policy_family(path: str | Path) -> PolicyFamily:
    """The one family whose files the folder ``path`` holds.

    Raises a :class:`~mmrl.errors.CheckpointError` (a FileNotFoundError) naming the folder and
    what each family expects when none (or, for an ambiguous folder, more than one) matches.
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(
            f"actor_rollout_ref.model.path={str(path)!r} is not a folder; models are read from "
            "local save_pretrained folders and never downloaded"
        )
    families = [FAMILIES.get(name) for name in FAMILIES]
    found = [family for family in families if family.detect(path)]
    if len(found) != 1:
        kinds = "; ".join(f"{f.name}: {f.describe()}" for f in families)
        what = "no known policy" if not found else f"{len(found)} kinds of policy"
        raise CheckpointError(
            f"{str(path)!r} holds {what} (files: {sorted(p.name for p in path.iterdir())[:8]}); "
            f"expected one of {kinds}"
        )
    return found[0]
