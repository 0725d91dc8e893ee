"""Slow tier: the trained tokenizer, autoencoder, latent policy and token world model.

Trained artefacts are shared through session fixtures, so each is trained once.
"""

import json

import numpy as np
import pytest
import torch

from mmrl.models.latent_policy import (
    GaussianLatentPolicy,
    LatentPolicyConfig,
)
from mmrl.worldmodel.data import TrajectoryDataset, generate_dataset
from mmrl.worldmodel.envs import make_env, states_equal
from mmrl.worldmodel.latent_pretrain import latent_windows, pretrain_latent_policy
from mmrl.worldmodel.pretrain import load_pretrain_config, pretrain_token_world_model
from mmrl.worldmodel.token_lm import load_token_world_model
from mmrl.worldmodel.tokenizer import AETrainConfig, VQConfig

pytestmark = pytest.mark.slow

# Small enough for two cores; the pretraining test reuses the tokenizer through its cache.
TINY_VQ = VQConfig(codebook_size=64, block_out_channels=[16, 32, 32])
TINY_VQ_TRAIN = AETrainConfig(steps=250, batch_size=16, lr=2e-3)


@pytest.fixture(scope="session")
def grid_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("wm_data")
    train = generate_dataset("grid", 48, 8, root / "train", seed=0, progress=False)
    val = generate_dataset("grid", 8, 8, root / "val", seed=1, progress=False)
    return train, val


@pytest.fixture(scope="session")
def grid_tokenizer(grid_data, tmp_path_factory):
    from mmrl.worldmodel.tokenizer import train_vq_tokenizer

    out = tmp_path_factory.mktemp("wm_tok")
    return out, train_vq_tokenizer(
        grid_data[0], out, cfg=TINY_VQ, train=TINY_VQ_TRAIN, progress=False
    )


@pytest.fixture(scope="session")
def grid_latent_ae(grid_data, tmp_path_factory):
    from mmrl.worldmodel.latent_ae import AEConfig, train_latent_ae

    out = tmp_path_factory.mktemp("wm_ae")
    return out, train_latent_ae(
        grid_data[0],
        out,
        cfg=AEConfig(),
        train=AETrainConfig(steps=150, batch_size=16),
        progress=False,
    )


def test_vq_tokenizer_beats_mean_frame_and_caches(grid_data, grid_tokenizer):
    from mmrl.worldmodel.frames import psnr
    from mmrl.worldmodel.tokenizer import train_vq_tokenizer

    out, tok = grid_tokenizer
    held_out = TrajectoryDataset(grid_data[1]).all_frames().reshape(-1, 32, 32, 3)
    ids = tok.encode(held_out)
    assert ids.shape == (len(held_out), 8, 8) and ids.dtype == np.int64 and ids.max() < 64
    recon = tok.decode(ids)
    mean_frame = TrajectoryDataset(grid_data[0]).all_frames().mean((0, 1)).round().astype(np.uint8)
    baseline = psnr(np.broadcast_to(mean_frame, held_out.shape), held_out)
    score = psnr(recon, held_out)
    env = make_env("grid")
    match = np.mean(
        [
            states_equal(env.state_from_frame(r), env.state_from_frame(f))
            for r, f in zip(recon, held_out, strict=True)
        ]
    )
    print(
        f"VQ held-out PSNR {score:.2f} dB vs mean frame {baseline:.2f} dB; state match {match:.2f}"
    )
    assert score > baseline + 6.0
    assert match > 0.5  # the agent cell survives tokenization
    weights = out / "diffusion_pytorch_model.safetensors"
    stamp = weights.stat().st_mtime_ns
    again = train_vq_tokenizer(grid_data[0], out, cfg=TINY_VQ, train=TINY_VQ_TRAIN, progress=False)
    assert weights.stat().st_mtime_ns == stamp  # cache hit: not retrained
    assert np.array_equal(again.encode(held_out[:8]), ids[:8])


def test_latent_autoencoder_trains_and_standardises(grid_data, grid_latent_ae):
    from mmrl.worldmodel.frames import psnr
    from mmrl.worldmodel.latent_ae import LatentAutoencoder

    out, ae = grid_latent_ae
    frames = TrajectoryDataset(grid_data[1]).all_frames().reshape(-1, 32, 32, 3)
    z = ae.encode(frames)
    assert z.shape == (len(frames), 4, 8, 8)
    assert abs(z.mean().item()) < 0.5 and 0.5 < z.std().item() < 2.0
    mean_frame = np.broadcast_to(frames.mean(0).round().astype(np.uint8), frames.shape)
    assert psnr(ae.decode(z), frames) > psnr(mean_frame, frames) + 3.0
    loaded = LatentAutoencoder.from_pretrained(out)
    assert torch.allclose(loaded.encode(frames[:4]), z[:4], atol=1e-5)


def test_pretrain_token_world_model_end_to_end(grid_data, grid_tokenizer, tmp_path):
    tok_dir, _ = grid_tokenizer
    cfg = load_pretrain_config(
        [
            f"output_dir={tmp_path}",
            f"tokenizer.dir={tok_dir}",  # same data settings and tokenizer: a cache hit
            "tokenizer.model.codebook_size=64",
            "tokenizer.model.kind=conv",
            f"tokenizer.train.steps={TINY_VQ_TRAIN.steps}",
            f"tokenizer.train.batch_size={TINY_VQ_TRAIN.batch_size}",
            "data.train_trajectories=48",
            "data.val_trajectories=8",
            "data.length=8",
            "train.steps=40",
            "train.val_every=20",
            "train.eval_windows=8",
            "progress_bar=false",
        ]
    )
    result = pretrain_token_world_model(cfg)
    history = [
        json.loads(line) for line in (tmp_path / "pretrain_metrics.jsonl").read_text().splitlines()
    ]
    assert [h["step"] for h in history] == [20, 40]
    assert history[-1]["val/loss"] < history[0]["val/loss"] < np.log(64 + 10)
    s = result.summary
    assert s["stop_reason"] == "budget" and s["steps_run"] == 40
    assert s["val/valid_fraction"] == 1.0 and np.isfinite(s["val/psnr_greedy"])
    model, proc = load_token_world_model(result.best_dir)
    assert proc.layout.codebook_size == 64 and proc.context == 2
    assert (tmp_path / "token_wm" / "last" / "tokenizer.json").exists()


def test_latent_policy_mle_lowers_held_out_nll(grid_data, grid_latent_ae):
    _, ae = grid_latent_ae
    train = latent_windows(grid_data[0], ae, context=2)
    val = latent_windows(grid_data[1], ae, context=2)
    assert train[0].shape[1:] == (2, 4, 8, 8) and train[1].shape[1:] == (2, 1)
    policy = GaussianLatentPolicy(LatentPolicyConfig(context=2, action_dim=1, hidden=32))
    history = pretrain_latent_policy(policy, train, val, steps=150, val_every=50, progress=False)
    assert history[-1]["val/nll"] < history[0]["val/nll"] and np.isfinite(history[-1]["val/mse"])
