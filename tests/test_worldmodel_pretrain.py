"""Pretraining plumbing: the plateau rule, the config, and the sequence layout."""

import numpy as np
import pytest
import torch

from mmrl.errors import ConfigError
from mmrl.worldmodel.data import TrajectoryDataset, generate_dataset
from mmrl.worldmodel.pretrain import below_copying, load_pretrain_config, plateaued
from mmrl.worldmodel.pretrain_data import IGNORE, encode_sequences
from mmrl.worldmodel.token_lm import TokenWorldModelProcessor
from mmrl.worldmodel.tokenizer import VQConfig, VQTokenizer, build_vq_model
from mmrl.worldmodel.vocab import VocabLayout


def test_plateau_rule():
    assert not plateaued([3.0, 2.0], patience=2, min_delta=0.01)
    assert not plateaued([3.0, 2.0, 1.5, 1.6], patience=2, min_delta=0.01)
    assert plateaued([3.0, 2.0, 1.995, 2.1], patience=2, min_delta=0.01)
    assert not plateaued([3.0, 2.0, 2.1, 2.2], patience=0, min_delta=0.01)


def test_a_base_below_copying_is_named_in_one_line_with_the_keys_to_change():
    # the numbers of a pretraining seed that stopped on a plateau before learning the motion
    summary = {
        "val/psnr_greedy": 23.81,
        "val/psnr_copy_last_frame": 47.74,
        "best_val_loss": 0.0635,
        "best_step": 500,
    }
    line = below_copying(summary, 2e-3, prefix="task.pretrain.")
    assert "23.81 against 47.74 dB" in line and "step 500" in line
    assert "task.pretrain.train.lr=0.001" in line and "\n" not in line
    # from the default lr the line suggests half of it, with the CLI's own keys
    assert "train.lr=0.0005" in below_copying(summary, 1e-3)
    assert "task." not in below_copying(summary, 1e-3)
    assert below_copying({**summary, "val/psnr_greedy": 47.75}, 2e-3) is None


def test_config_composes_with_overrides():
    cfg = load_pretrain_config(["data.env=push", "train.steps=7", "output_dir=/tmp/x"])
    assert cfg.data.env == "push" and cfg.train.steps == 7
    assert cfg.data.dir == "/tmp/x/data" and cfg.tokenizer.dir == "/tmp/x/tokenizer"
    assert cfg.model.hidden_size // cfg.model.num_attention_heads >= 64
    with pytest.raises(Exception, match="nonexistent"):
        load_pretrain_config(["train.nonexistent=1"])


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("train.lr=abc", "train.lr: Value 'abc' of type 'str' could not be converted to Float"),
        ("train.lr=-1", "train.lr=-1.0: must be > 0"),
        ("train.steps=0", "train.steps=0: must be >= 1"),
        ("train.min_lr_ratio=2", "train.min_lr_ratio=2.0: must be <= 1"),
    ],
)
def test_a_bad_pretraining_value_is_one_line_before_any_work(override, message, tmp_path):
    with pytest.raises(ConfigError) as err:
        load_pretrain_config([override, f"output_dir={tmp_path / 'run'}"])
    assert message in str(err.value) and len(str(err.value).splitlines()) == 1
    assert not (tmp_path / "run").exists()


def test_a_bad_pretraining_value_under_the_task_names_its_full_key(tmp_path):
    from mmrl.tasks.worldmodel_tokens import pretrain_config

    with pytest.raises(ConfigError, match=r"^task\.pretrain\.train\.lr=-1\.0: must be > 0$"):
        pretrain_config({"train": {"lr": -1.0}}, str(tmp_path))


def test_encode_sequences_layout(tmp_path):
    data_dir = generate_dataset("push", 2, 5, tmp_path, seed=0, progress=False)
    torch.manual_seed(0)
    tok = VQTokenizer(build_vq_model(VQConfig(codebook_size=16, block_out_channels=[8, 8, 8]), 32))
    action = TrajectoryDataset(data_dir).info.action
    proc = TokenWorldModelProcessor(VocabLayout(16, tok.grid, action), context=2, future=1)
    ids, labels = encode_sequences(data_dir, tok, proc)
    assert ids.shape == (2 * 3, proc.prompt_length + proc.response_length)
    learned = labels != IGNORE
    assert learned.sum(1).tolist() == [2 * 64] * 6  # second context frame + response
    assert torch.equal(labels[learned], ids[learned])
    assert (ids[:, -64:] >= 5).all() and (ids[:, -64:] < 21).all()


def test_greedy_responses_match_full_recompute_and_stay_visual():
    from mmrl.worldmodel.envs import ActionSpec
    from mmrl.worldmodel.pretrain import greedy_responses
    from mmrl.worldmodel.token_lm import TokenLMConfig, build_token_world_model

    layout = VocabLayout(16, (2, 2), ActionSpec(kind="discrete", dim=1, num_actions=5))
    proc = TokenWorldModelProcessor(layout, context=1, future=2)
    torch.manual_seed(0)
    model = build_token_world_model(
        proc,
        TokenLMConfig(64, 64, 1, 1, 1, max_position_embeddings=64),
    )
    rng = np.random.default_rng(0)
    prompts = torch.tensor(
        [proc.build_prompt(rng.integers(0, 16, (1, 2, 2)), [[1.0], [3.0]]) for _ in range(3)]
    )
    out = greedy_responses(model, prompts, proc)
    assert out.shape == (3, proc.response_length)
    assert all(proc.decode_response(r).valid for r in out.tolist())
    ids = prompts
    allowed = torch.tensor(proc.allowed_token_ids())
    for _ in range(proc.response_length):  # no KV cache: recompute everything each step
        logits = model(input_ids=ids).logits[:, -1, allowed]
        ids = torch.cat([ids, allowed[logits.argmax(-1)][:, None]], dim=1)
    assert torch.equal(out, ids[:, prompts.shape[1] :])


def test_pretraining_starts_from_a_one_frame_model_with_the_same_vocabulary(tmp_path):
    from mmrl.worldmodel.envs import ActionSpec
    from mmrl.worldmodel.pretrain import initial_model
    from mmrl.worldmodel.token_lm import (
        TokenLMConfig,
        build_token_world_model,
        save_token_world_model,
    )

    action = ActionSpec(kind="discrete", dim=1, num_actions=5)
    one_frame = TokenWorldModelProcessor(VocabLayout(16, (2, 2), action), context=2, future=1)
    torch.manual_seed(0)
    source = build_token_world_model(one_frame, TokenLMConfig(64, 64, 1, 1, 1, 128))
    save_token_world_model(source, one_frame, tmp_path / "f1")
    same_model = [
        "model.hidden_size=64",
        "model.intermediate_size=64",
        "model.num_hidden_layers=1",
        "model.num_attention_heads=1",
        "model.num_key_value_heads=1",
        "model.max_position_embeddings=128",
    ]
    start = [f"output_dir={tmp_path}", f"train.init_from={tmp_path / 'f1'}"]
    cfg = load_pretrain_config(start + same_model)
    four = TokenWorldModelProcessor(
        VocabLayout(16, (2, 2), action), context=2, future=4, action_form="interleaved"
    )
    model = initial_model(four, cfg)
    for (name, a), b in zip(source.state_dict().items(), model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    other = TokenWorldModelProcessor(VocabLayout(32, (2, 2), action), context=2, future=4)
    with pytest.raises(ValueError, match="another vocabulary"):
        initial_model(other, cfg)
    # the run's config must describe the model it trains: model.* cannot silently lose
    with pytest.raises(ValueError, match=r"num_hidden_layers=4 \(init_from has 1\)"):
        initial_model(four, load_pretrain_config(start + same_model[:2]))
    # The same layout with other tokenizer weights gives the same ids other meanings.
    from safetensors.torch import save_file

    for folder, value in ((tmp_path / "f1" / "vq_tokenizer", 1.0), (tmp_path / "tokenizer", 2.0)):
        folder.mkdir()
        (folder / "config.json").write_text("{}")
        save_file({"codebook": torch.full((16, 4), value)}, folder / "model.safetensors")
    with pytest.raises(
        ValueError, match=r"VQ tokenizer in .*f1/vq_tokenizer, whose weights differ"
    ):
        initial_model(four, cfg)
    save_file({"codebook": torch.full((16, 4), 1.0)}, tmp_path / "tokenizer" / "model.safetensors")
    assert initial_model(four, cfg) is not None  # a copy of the same weights is the same tokenizer
