"""Loading a policy and its tokenizer from a local folder; nothing is ever downloaded."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoTokenizer,
)

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
        raise ValueError(
            f"actor_rollout_ref.model.dtype={dtype!r}; expected one of {sorted(DTYPES)}"
        )
    # A VLM (Qwen2-VL, Qwen2.5-VL: the config has a vision tower) loads with its vision tower.
    vlm = (
        getattr(AutoConfig.from_pretrained(path, local_files_only=True), "vision_config", None)
        is not None
    )
    auto = AutoModelForImageTextToText if vlm else AutoModelForCausalLM
    return auto.from_pretrained(path, dtype=DTYPES[dtype], local_files_only=True)


def load_policy(path: str | Path, dtype: str = "float32") -> tuple[torch.nn.Module, object | None]:
    """The actor and its tokenizer from a local folder; the folder's files say which kind.

    A latent world-model policy (``latent_policy.json``) has no tokenizer (``None``);
    anything else is a transformers causal LM with its tokenizer.
    """
    if (Path(path) / "latent_policy.json").is_file():
        # Imported here: it loads diffusers, which an LM run never needs.
        from mmrl.models.latent_policy import GaussianLatentPolicy

        return GaussianLatentPolicy.from_pretrained(path).to(DTYPES[dtype]), None
    return load_causal_lm(path, dtype), AutoTokenizer.from_pretrained(path, local_files_only=True)
