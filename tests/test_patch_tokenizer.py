"""The patch tokenizers keep what does not move: one code per patch, from that patch alone."""

import json

import numpy as np
import torch

from mmrl.worldmodel.data import TrajectoryDataset, generate_dataset
from mmrl.worldmodel.envs import ActionSpec
from mmrl.worldmodel.patch_kmeans import PatchKMeansModel
from mmrl.worldmodel.patch_vq import PatchVQModel
from mmrl.worldmodel.pretrain import weighted_lm_loss
from mmrl.worldmodel.pretrain_data import changed_tokens
from mmrl.worldmodel.token_lm import (
    TokenLMConfig,
    TokenWorldModelProcessor,
    build_token_world_model,
)
from mmrl.worldmodel.tokenizer import (
    AETrainConfig,
    VQConfig,
    VQTokenizer,
    build_vq_model,
    train_vq_tokenizer,
)
from mmrl.worldmodel.vocab import VocabLayout


def test_a_code_reads_and_writes_its_own_patch_only(tmp_path):
    torch.manual_seed(0)
    tok = VQTokenizer(build_vq_model(VQConfig(kind="patch", codebook_size=64), (48, 64)))
    assert isinstance(tok.model, PatchVQModel)
    assert tok.grid == (6, 8)  # 8x downsampling keeps 48x64 at <= 64 tokens
    rng = np.random.default_rng(0)
    frames = rng.integers(0, 256, (4, 48, 64, 3), dtype=np.uint8)
    codes = tok.encode(frames)
    edited = frames.copy()
    edited[:, 8:16, 16:24] = 255 - edited[:, 8:16, 16:24]  # patch (1, 2) only
    changed = tok.encode(edited) != codes
    outside = np.ones((6, 8), bool)
    outside[1, 2] = False
    assert not changed[:, outside].any()
    assert changed[:, 1, 2].any()
    ids = codes.copy()
    ids[:, 3, 5] = (ids[:, 3, 5] + 1) % 64
    pixels_changed = (tok.decode(ids) != tok.decode(codes)).any(-1)
    assert pixels_changed[:, 24:32, 40:48].any()
    pixels_changed[:, 24:32, 40:48] = False
    assert not pixels_changed.any()
    tok.save_pretrained(tmp_path / "tok")
    again = VQTokenizer.from_pretrained(tmp_path / "tok")
    assert isinstance(again.model, PatchVQModel)
    np.testing.assert_array_equal(again.encode(frames), codes)


def test_trained_on_the_grid_world_a_step_changes_two_codes(tmp_path):
    data = generate_dataset("grid", 24, 8, tmp_path / "data", seed=0, progress=False)
    tok = train_vq_tokenizer(
        data, tmp_path / "tok", cfg=VQConfig(kind="patch"), train=AETrainConfig(steps=200),
        progress=False,
    )  # fmt: skip
    frames = TrajectoryDataset(data).trajectory(0).frames
    codes = tok.encode(frames)
    assert len(np.unique(tok.encode(TrajectoryDataset(data).trajectory(1).frames))) <= 6
    moved = (frames[1:] != frames[:-1]).any(-1).reshape(7, 8, 4, 8, 4).any((2, 4))
    np.testing.assert_array_equal(codes[1:] != codes[:-1], moved)  # the cells that changed
    assert moved.any()


def test_changed_tokens_mark_what_differs_from_the_frame_before_and_weights_keep_the_mean():
    layout = VocabLayout(16, (2, 2), ActionSpec(kind="discrete", dim=1, num_actions=5))
    proc = TokenWorldModelProcessor(layout, context=2, future=1)
    codes = np.array([[[1, 2], [3, 4]], [[1, 2], [3, 9]], [[7, 2], [3, 9]]])
    prompt = proc.build_prompt(codes[:2], [[0.0], [1.0]])
    ids = torch.tensor([prompt + proc.build_response(codes[2:])])
    changed = changed_tokens(ids, proc)
    visual = torch.nonzero((ids[0] >= layout.visual_offset) & (ids[0] < layout.action_offset))
    frames = changed[0, visual.reshape(-1)].reshape(3, 4)
    assert frames.tolist() == [[False] * 4, [False] * 3 + [True], [True] + [False] * 3]
    assert changed.sum() == 2
    torch.manual_seed(0)
    lm = TokenLMConfig(64, 64, 1, 1, 1, max_position_embeddings=64)
    model = build_token_world_model(proc, lm)
    labels = torch.where(changed | (torch.arange(ids.shape[1]) > 10), ids, -100)
    mean = weighted_lm_loss(model, ids, labels, torch.ones(ids.shape, dtype=torch.float32))
    torch.testing.assert_close(mean, model(input_ids=ids, labels=labels).loss)
    weighted = weighted_lm_loss(model, ids, labels, 1.0 + 9.0 * changed.float())
    assert not torch.isclose(weighted, mean)


def distinct_patches(frames: np.ndarray, patch: int) -> int:
    n, h, w, _ = frames.shape
    blocks = frames.reshape(n, h // patch, patch, w // patch, patch, 3).transpose(0, 1, 3, 2, 4, 5)
    return len(np.unique(blocks.reshape(-1, patch * patch * 3), axis=0))


def test_kmeans_codes_reconstruct_every_patch_of_a_rendered_world_exactly(tmp_path):
    """Push-world discs sit at any pixel; a learned 128-code VQ blurs them (docs/worldmodel.md).
    With at least one code per distinct patch, k-means codes are the patches themselves."""
    data = generate_dataset("push", 12, 8, tmp_path / "data", seed=0, progress=False)
    train = np.concatenate(list(TrajectoryDataset(data).frames()))
    distinct = distinct_patches(train, 4)
    assert 64 < distinct < 512  # more than a small codebook holds, fewer than this one
    cfg = VQConfig(kind="kmeans", codebook_size=512)
    tok = train_vq_tokenizer(data, tmp_path / "tok", cfg=cfg, progress=False)
    assert isinstance(tok.model, PatchKMeansModel) and tok.grid == (8, 8)
    codes = tok.encode(train)
    np.testing.assert_array_equal(tok.decode(codes), train)
    assert len(np.unique(codes)) == distinct  # the spare codes are never assigned
    # A code reads its own patch only: what does not move keeps its code.
    moved = (train[1:8] != train[:7]).any(-1).reshape(7, 8, 4, 8, 4).any((2, 4))
    np.testing.assert_array_equal(codes[1:8] != codes[:7], moved)
    record = json.loads((tmp_path / "tok" / "mmrl_cache.json").read_text())
    assert record["distinct_patches"] == distinct and record["psnr"] == 60.0
    again = VQTokenizer.from_pretrained(tmp_path / "tok")
    assert isinstance(again.model, PatchKMeansModel)
    np.testing.assert_array_equal(again.encode(train), codes)
    # Fewer codes than distinct patches: each patch goes to its nearest centre, and a small
    # codebook loses detail, never whole frames.
    small = train_vq_tokenizer(
        data, tmp_path / "small", cfg=VQConfig(kind="kmeans", codebook_size=64), progress=False
    )
    assert len(np.unique(small.encode(train))) == 64
    err = np.abs(small.decode(small.encode(train)).astype(int) - train).mean()
    assert 0 < err < 0.5 * np.abs(train.astype(int) - train.mean((0, 1, 2))).mean()
