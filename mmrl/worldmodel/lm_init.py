"""Where the token world model's MLE pretraining starts: random weights, or ``train.init_from``.

A model trained on one-frame futures can start the training of longer ones, as long as its
token ids mean the same things: the same vocabulary layout, and the same VQ tokenizer weights
(the layout only says how many codes there are, not which patch each code draws).
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file
from transformers import PreTrainedModel

from mmrl.worldmodel.token_lm import (
    TokenWorldModelProcessor,
    build_token_world_model,
    load_token_world_model,
)

if TYPE_CHECKING:
    from mmrl.worldmodel.pretrain_config import PretrainConfig

logger = logging.getLogger(__name__)
TOKENIZER_SUBDIR = "vq_tokenizer"  # where a complete world-model checkpoint carries it


def initial_model(processor: TokenWorldModelProcessor, cfg: PretrainConfig) -> PreTrainedModel:
    """Random weights, or ``train.init_from``'s: a token world model with the same vocabulary
    (tokenizer weights and actions) and any context, future or action form."""
    if cfg.train.init_from is None:
        return build_token_world_model(processor, cfg.model)
    init_from = Path(cfg.train.init_from)
    model, start = load_token_world_model(init_from)
    if start.layout.to_json() != processor.layout.to_json():
        raise ValueError(
            f"train.init_from={init_from} has another vocabulary (tokenizer or "
            "actions) than this data; start from a model trained with the same tokenizer"
        )
    check_same_tokenizer(init_from, Path(cfg.tokenizer.dir))
    differ = [
        f"{key}={value} (init_from has {getattr(model.config, key)})"
        for key, value in asdict(cfg.model).items()
        if getattr(model.config, key) != value
    ]
    if differ:
        raise ValueError(
            f"train.init_from={init_from} keeps its own architecture, but model.* asks "
            f"for {', '.join(differ)}; drop those overrides or start from random weights"
        )
    processor.check_model_config(model.config)
    return model


def tokenizer_of(model_dir: Path) -> Path | None:
    """The VQ tokenizer a token world model was trained with: its own ``vq_tokenizer/``, or
    the ``tokenizer.dir`` of the pretraining run whose ``token_wm/<best|last>`` it is."""
    if (model_dir / TOKENIZER_SUBDIR / "config.json").is_file():
        return model_dir / TOKENIZER_SUBDIR
    summary = model_dir.parent.parent / "pretrain_summary.json"
    if summary.is_file():
        found = Path(json.loads(summary.read_text())["config"]["tokenizer"]["dir"])
        return found if (found / "config.json").is_file() else None
    return None


def same_weights(a: Path, b: Path) -> bool:
    """Whether two model folders hold the same tensors in their safetensors files."""
    files_a, files_b = sorted(a.glob("*.safetensors")), sorted(b.glob("*.safetensors"))
    if not files_a or [f.name for f in files_a] != [f.name for f in files_b]:
        return False
    for fa, fb in zip(files_a, files_b, strict=True):
        ta, tb = load_file(fa), load_file(fb)
        if ta.keys() != tb.keys() or not all(torch.equal(ta[k], tb[k]) for k in ta):
            return False
    return True


def check_same_tokenizer(init_from: Path, tokenizer_dir: Path) -> None:
    """Refuse a start whose VQ tokenizer has other weights than this run's: the same ids
    would draw other patches. Without a tokenizer beside ``init_from``, say it is unchecked."""
    theirs = tokenizer_of(init_from)
    if theirs is None or not (tokenizer_dir / "config.json").is_file():
        logger.warning(
            "train.init_from=%s: no VQ tokenizer beside it (%s/ or its pretraining's "
            "tokenizer.dir), so it is not checked to be this run's tokenizer.dir=%s",
            init_from, TOKENIZER_SUBDIR, tokenizer_dir,
        )  # fmt: skip
        return
    if theirs.resolve() != tokenizer_dir.resolve() and not same_weights(theirs, tokenizer_dir):
        raise ValueError(
            f"train.init_from={init_from} was trained with the VQ tokenizer in {theirs}, whose "
            f"weights differ from this run's tokenizer.dir={tokenizer_dir}: its token ids would "
            f"draw other patches; set tokenizer.dir={theirs} (or ++task.pretrain.tokenizer.dir "
            "under mmrl train)"
        )
