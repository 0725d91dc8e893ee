"""Vocabulary layout, prompt/response building, and decoding of malformed responses."""

import numpy as np
import pytest
import torch

from mmrl.worldmodel.envs import ActionSpec
from mmrl.worldmodel.token_lm import (
    TokenLMConfig,
    TokenWorldModelProcessor,
    build_token_world_model,
    load_token_world_model,
    save_token_world_model,
)
from mmrl.worldmodel.tokenizer import VQConfig, VQTokenizer, build_vq_model
from mmrl.worldmodel.vocab import ACTION, BOS, FRAME, PAD, VocabLayout, build_hf_tokenizer

DISCRETE = ActionSpec(kind="discrete", dim=1, num_actions=5)
CONTINUOUS = ActionSpec(kind="continuous", dim=2, low=-1.0, high=1.0)


def layout(action=DISCRETE, grid=(4, 4), codebook=16, bins=9) -> VocabLayout:
    return VocabLayout(codebook_size=codebook, grid=grid, action=action, action_bins=bins)


def test_layout_ranges_do_not_overlap():
    lay = layout(CONTINUOUS)
    assert lay.visual_offset == 5 and lay.action_offset == 5 + 16
    assert lay.vocab_size == 5 + 16 + 2 * 9 == len(lay.token_names())
    assert lay.visual_ids() == list(range(5, 21))
    ids = lay.action_to_ids(np.array([[-1.0, 1.0], [0.0, 0.05], [-5.0, 5.0]]))
    assert ids.tolist() == [[21, 21 + 9 + 8], [21 + 4, 21 + 9 + 4], [21, 21 + 9 + 8]]
    centres = lay.ids_to_action(ids)
    assert np.allclose(centres[1], [0.0, 0.0]) and np.all(np.abs(centres) <= 1)
    assert VocabLayout.from_json(lay.to_json()) == lay


def test_layout_errors_are_clear():
    with pytest.raises(ValueError, match="action_bins >= 2"):
        layout(CONTINUOUS, bins=1)
    with pytest.raises(ValueError, match=r"codes must be in \[0, 16\)"):
        layout().codes_to_ids(np.full((4, 4), 16))
    with pytest.raises(ValueError, match=r"expected codes \[\.\.\., 4, 4\]"):
        layout().codes_to_ids(np.zeros((3, 3)))
    with pytest.raises(ValueError, match=r"integers in \[0, 5\)"):
        layout().action_to_ids(np.array([[5.0]]))
    bad = {**layout().to_json(), "vocab_size": 99}
    with pytest.raises(ValueError, match="vocab_size 99"):
        VocabLayout.from_json(bad)


@pytest.mark.parametrize("action", [DISCRETE, CONTINUOUS])
def test_prompt_and_response_layout(action):
    proc = TokenWorldModelProcessor(layout(action), context=2, future=2)
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 16, size=(4, 4, 4))
    acts = (
        rng.integers(0, 5, size=(3, 1)).astype(np.float32)
        if action is DISCRETE
        else rng.uniform(-1, 1, (3, 2))
    )
    prompt = proc.build_prompt(codes[:2], acts)
    response = proc.build_response(codes[2:])
    tpa = action.dim
    assert len(prompt) == proc.prompt_length and len(response) == proc.response_length == 32
    assert prompt[:2] == [BOS, FRAME] and prompt[-1] == FRAME
    assert prompt[2:18] == (codes[0].reshape(-1) + 5).tolist()
    assert prompt.count(FRAME) == 3 and prompt.count(ACTION) == 3
    assert prompt[18] == ACTION and prompt[19 + tpa] == FRAME
    decoded = proc.decode_response(response)
    assert decoded.valid and np.array_equal(decoded.codes, codes[2:])
    mask = proc.label_mask(prompt)
    assert mask.sum() == 16 and not mask[:18].any()  # only the second context frame is learned


def test_prompt_errors_name_the_counts():
    proc = TokenWorldModelProcessor(layout(), context=2, future=2)
    with pytest.raises(ValueError, match=r"expected 3 actions \(2 context \+ 2 future - 1\)"):
        proc.build_prompt(np.zeros((2, 4, 4), int), np.zeros((2, 1)))
    with pytest.raises(ValueError, match="expected 2 context frames"):
        proc.build_prompt(np.zeros((3, 4, 4), int), np.zeros((3, 1)))


def test_malformed_responses_are_invalid_not_errors():
    proc = TokenWorldModelProcessor(layout(), context=1, future=1)
    good = list(range(5, 21))
    assert proc.decode_response(good + [PAD, PAD]).valid  # right padding is fine
    short = proc.decode_response(good[:-1])
    assert not short.valid and short.codes is None and "expected 16 visual tokens" in short.reason
    assert "found 17" in proc.decode_response(good + [5]).reason
    assert (
        "token 21 at position 3 is not visual"
        in proc.decode_response(good[:3] + [21] + good[4:]).reason
    )
    assert "token 3 at position 0" in proc.decode_response([FRAME] + good[1:]).reason
    assert not proc.decode_response([]).valid


def test_decode_frames_marks_bad_samples():
    torch.manual_seed(0)
    tok = VQTokenizer(build_vq_model(VQConfig(codebook_size=16, block_out_channels=[8, 8, 8]), 16))
    proc = TokenWorldModelProcessor(layout(grid=tok.grid), context=1, future=1)
    good = list(range(5, 21))
    frames, valid, reasons = proc.decode_frames([good, good[:4], good[::-1]], tok)
    assert frames.shape == (3, 1, 16, 16, 3) and frames.dtype == np.uint8
    assert valid.tolist() == [True, False, True] and reasons[1] and not frames[1].any()
    other = TokenWorldModelProcessor(layout(grid=tok.grid, codebook=32), context=1)
    with pytest.raises(ValueError, match="codebook 16 .* expects codebook 32"):
        other.decode_frames([good], tok)


def test_model_config_checks_and_save_load(tmp_path):
    proc = TokenWorldModelProcessor(layout(CONTINUOUS), context=2, future=1)
    with pytest.raises(ValueError, match="head_dim 32 < 64"):
        build_token_world_model(proc, TokenLMConfig(hidden_size=64, num_attention_heads=2))
    with pytest.raises(ValueError, match="max_position_embeddings 16 < prompt\\+response"):
        build_token_world_model(
            proc, TokenLMConfig(hidden_size=64, num_attention_heads=1, max_position_embeddings=16)
        )
    cfg = TokenLMConfig(
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
        max_position_embeddings=128,
    )
    model = build_token_world_model(proc, cfg)
    save_token_world_model(model, proc, tmp_path)
    loaded, loaded_proc = load_token_world_model(tmp_path)
    assert loaded_proc.to_json() == proc.to_json() and not loaded.config.tie_word_embeddings
    ids = torch.tensor([proc.build_prompt(np.zeros((2, 4, 4), int), np.zeros((2, 2)))])
    assert torch.equal(model(ids).logits, loaded(ids).logits)
    hf_tok = build_hf_tokenizer(proc.layout)
    assert len(hf_tok) == proc.layout.vocab_size and hf_tok.pad_token_id == PAD
    assert hf_tok.decode([BOS, 5, proc.layout.action_offset]) == "<bos> <v0> <a0_0>"
