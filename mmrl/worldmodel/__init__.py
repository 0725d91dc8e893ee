"""World models: environments, trajectory data, the video tokenizer and latent
autoencoder, the token world model and the latent policy, and their pretraining.

Environments and data import light; the model classes load diffusers/transformers
on first access.
"""

from importlib import import_module
from typing import Any

from mmrl.worldmodel.data import TrajectoryDataset, WindowDataset, generate_dataset
from mmrl.worldmodel.envs import ENVS, ActionSpec, Env, make_env, register_env
from mmrl.worldmodel.video import VideoDataset

_LAZY = {
    "VQTokenizer": "tokenizer",
    "train_vq_tokenizer": "tokenizer",
    "LatentAutoencoder": "latent_ae",
    "train_latent_ae": "latent_ae",
    "VocabLayout": "vocab",
    "TokenWorldModelProcessor": "token_lm",
    "build_token_world_model": "token_lm",
    "load_token_world_model": "token_lm",
    "save_token_world_model": "token_lm",
    "GaussianLatentPolicy": "latent_policy",
    "pretrain_token_world_model": "pretrain",
}

__all__ = [
    "ENVS",
    "ActionSpec",
    "Env",
    "TrajectoryDataset",
    "VideoDataset",
    "WindowDataset",
    "generate_dataset",
    "make_env",
    "register_env",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(f"mmrl.worldmodel.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'mmrl.worldmodel' has no attribute {name!r}")
