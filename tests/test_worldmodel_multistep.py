"""Multi-step futures with the known actions interleaved (``action_form=interleaved``): the
layout, pretraining labels, the hf engine writing the actions into the response with no
log-prob and no loss, and per-frame verifier scores placed on each frame's last token."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from mmrl import algos
from mmrl.config import load_config
from mmrl.models import get_family
from mmrl.processors.worldmodel import WorldModelPromptProcessor, load_windows
from mmrl.protocol import Batch
from mmrl.rollout.module import ModuleRollout
from mmrl.sampling import FORCED_KEY, SamplingParams
from mmrl.trainer.experience import apply_scores
from mmrl.trainer.fit import fit
from mmrl.verifiers import VerifierOutput, VerifierRunner, get_verifier
from mmrl.verifiers.base import check_output
from mmrl.worldmodel.data import TrajectoryDataset, generate_dataset
from mmrl.worldmodel.envs import ActionSpec
from mmrl.worldmodel.pretrain import greedy_responses
from mmrl.worldmodel.pretrain_data import IGNORE, encode_sequences
from mmrl.worldmodel.token_lm import (
    FREE,
    TokenLMConfig,
    TokenWorldModelProcessor,
    build_token_world_model,
)
from mmrl.worldmodel.tokenizer import VQConfig, VQTokenizer, build_vq_model
from mmrl.worldmodel.vocab import ACTION, BOS, FRAME, VocabLayout, build_hf_tokenizer
from tests.conftest import assert_rollout_matches_actor, run_overrides

TEXT_LM = get_family("text_lm")
CONTINUOUS = ActionSpec(kind="continuous", dim=2, low=-1.0, high=1.0)


def small_layout(action=CONTINUOUS) -> VocabLayout:
    return VocabLayout(codebook_size=16, grid=(2, 2), action=action, action_bins=9)


def test_interleaved_layout_puts_each_action_before_its_frame():
    proc = TokenWorldModelProcessor(small_layout(), context=2, future=3, action_form="interleaved")
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 16, size=(5, 2, 2))
    acts = rng.uniform(-1, 1, (4, 2))
    prompt = proc.build_prompt(codes[:2], acts)
    response = proc.build_response(codes[2:], acts)
    # prompt: <bos> <frame> v0 <action> A0 <frame> v1 <action> A1 <frame>
    assert len(prompt) == proc.prompt_length == 1 + 2 * 5 + 2 * 3 + 1
    assert prompt[:2] == [BOS, FRAME] and prompt[-1] == FRAME and prompt.count(ACTION) == 2
    # response: v2 <action> A2 <frame> v3 <action> A3 <frame> v4
    assert len(response) == proc.response_length == 3 * 4 + 2 * 4
    a_ids = proc.layout.action_to_ids(acts)
    assert response[4:8] == [ACTION, *a_ids[2].tolist(), FRAME]
    assert response[12:16] == [ACTION, *a_ids[3].tolist(), FRAME]
    assert response[:4] == (codes[2].reshape(-1) + 5).tolist()
    forced = proc.forced_response(acts)
    visual = proc.response_visual_mask()
    assert (forced[visual] == FREE).all() and forced[~visual].tolist() == [
        *response[4:8],
        *response[12:16],
    ]
    assert proc.frame_end_steps().tolist() == [3, 11, 19]
    decoded = proc.decode_response(response)
    assert decoded.valid and np.array_equal(decoded.codes, codes[2:])
    bad = list(response)
    bad[9] = ACTION  # a visual step of the second frame
    assert "position 9" in proc.decode_response(bad).reason
    back = TokenWorldModelProcessor.from_json(proc.to_json())
    assert back.action_form == "interleaved" and back.response_length == proc.response_length
    # the prompt form is unchanged: every action up front, visual tokens only
    up_front = TokenWorldModelProcessor(small_layout(), context=2, future=3)
    assert up_front.response_length == 12 and (up_front.forced_response(acts) == FREE).all()
    assert up_front.build_prompt(codes[:2], acts).count(ACTION) == 4
    with pytest.raises(ValueError, match="action_form='both'"):
        TokenWorldModelProcessor(small_layout(), 2, 3, action_form="both")


def test_pretraining_learns_visual_tokens_never_forced_actions(tmp_path):
    data_dir = generate_dataset("push", 2, 6, tmp_path, seed=0, progress=False)
    torch.manual_seed(0)
    tok = VQTokenizer(build_vq_model(VQConfig(codebook_size=16, block_out_channels=[8, 8, 8]), 32))
    action = TrajectoryDataset(data_dir).info.action
    layout = VocabLayout(16, tok.grid, action)
    proc = TokenWorldModelProcessor(layout, context=2, future=2, action_form="interleaved")
    ids, labels = encode_sequences(data_dir, tok, proc)
    assert ids.shape == (2 * 3, proc.prompt_length + proc.response_length)
    learned = labels != IGNORE
    # second context frame + the two predicted frames; the forced <action> A <frame> is not
    assert learned.sum(1).tolist() == [3 * 64] * 6
    response_labels = labels[:, proc.prompt_length :]
    visual = torch.from_numpy(proc.response_visual_mask())
    assert (response_labels[:, ~visual] == IGNORE).all()
    assert torch.equal(response_labels[:, visual], ids[:, proc.prompt_length :][:, visual])
    assert (ids[:, proc.prompt_length :][:, ~visual] >= layout.action_offset).sum() == 6 * 2


@pytest.fixture(scope="module")
def interleaved(tmp_path_factory):
    """A random tiny token world model (interleaved, K=2, F=3) with its prompt batch."""
    grid_dir = generate_dataset(
        "push", 3, 6, tmp_path_factory.mktemp("push"), seed=0, progress=False
    )
    torch.manual_seed(0)
    tok = VQTokenizer(build_vq_model(VQConfig(codebook_size=16, block_out_channels=[8, 8, 8]), 32))
    layout = VocabLayout(16, tok.grid, TrajectoryDataset(grid_dir).info.action)
    proc = TokenWorldModelProcessor(layout, context=2, future=3, action_form="interleaved")
    model = build_token_world_model(
        proc, TokenLMConfig(64, 64, 1, 1, 1, max_position_embeddings=512)
    )
    wm = WorldModelPromptProcessor(proc, tok)
    windows = load_windows(TrajectoryDataset(grid_dir), context=2, future=3)
    return model, wm, windows, build_hf_tokenizer(layout)


@pytest.mark.parametrize("do_sample", [True, False])
def test_hf_engine_writes_forced_actions_with_no_log_prob_and_no_loss(interleaved, do_sample):
    model, wm, windows, tokenizer = interleaved
    prompts = wm.encode_dataset(windows, "train")
    forced = prompts[FORCED_KEY]
    steps = forced[0] >= 0
    assert int(steps.sum()) == 2 * (2 + wm.tokens.layout.tokens_per_action)
    sampling = SamplingParams(
        do_sample=do_sample, temperature=1.3, seed=3, **wm.sampling_overrides()
    )
    out = ModuleRollout(model, TEXT_LM, tokenizer).generate(prompts, sampling)
    responses = out["responses"]
    assert torch.equal(responses[:, steps], forced[:, steps])  # exactly where the actions are
    assert (out["response_mask"][:, steps] == 0).all()
    assert (out["rollout_log_probs"][:, steps] == 0).all()
    assert (out["response_mask"][:, ~steps] == 1).all()
    assert (out["rollout_log_probs"][:, ~steps] < 0).all()
    # later frames attend to the forced actions
    assert out["attention_mask"].all()
    # sampled steps stay visual and decode to F frames
    visual = responses[:, ~steps]
    assert (
        (visual >= wm.tokens.layout.visual_offset) & (visual < wm.tokens.layout.action_offset)
    ).all()
    decoded = wm.decode(out)
    assert not decoded["pred_frames"].isnan().any()
    # the actor's recomputed log-probs equal the rollout's on the sampled tokens
    with torch.no_grad():
        recomputed, _ = TEXT_LM.response_log_probs(
            model, out, temperature=1.3 if do_sample else 1.0
        )
    mask = out["response_mask"].bool()
    assert torch.allclose(recomputed[mask], out["rollout_log_probs"][mask], atol=1e-4)


def test_greedy_eval_loop_agrees_with_the_hf_engine(interleaved):
    model, wm, windows, tokenizer = interleaved
    prompts = wm.encode_dataset(windows, "train")
    sampling = SamplingParams(do_sample=False, **wm.sampling_overrides())
    engine = ModuleRollout(model, TEXT_LM, tokenizer).generate(prompts, sampling)["responses"]
    loop = greedy_responses(model, prompts["input_ids"], wm.tokens, prompts[FORCED_KEY])
    assert torch.equal(engine, loop)


def frame_batch(future: int, rows: int = 4) -> Batch:
    """Predictions that drift more with every step: frame t is off by 0.05 * (t + 1)."""
    gen = torch.Generator().manual_seed(0)
    gt = torch.rand(rows, future, 32, 32, 3, generator=gen)
    drift = 0.05 * torch.arange(1, future + 1).view(1, future, 1, 1, 1)
    pred = (gt + drift * torch.randn(gt.shape, generator=gen)).clamp(0, 1)
    return Batch.from_dict(tensors={"pred_frames": pred, "gt_frames": gt})


def test_frame_verifiers_return_per_frame_scores_on_request():
    batch = frame_batch(future=3)
    per_frame = get_verifier("psnr")(batch, aggregate="per_frame")
    assert per_frame.scores.shape == (4, 3)
    assert (np.diff(per_frame.scores, axis=1) < 0).all()  # later frames drift more
    mean = get_verifier("psnr")(batch)  # the default is unchanged: one score per sample
    assert mean.scores.shape == (4,) and np.allclose(mean.scores, per_frame.scores.mean(1))
    assert get_verifier("lpips")(batch, aggregate="per_frame").scores.shape == (4, 3)
    assert get_verifier("psnr")(frame_batch(future=1), aggregate="per_frame").scores.shape == (4,)
    broken = per_frame.scores.copy()
    broken[1, 2] = np.nan
    out, nonfinite = check_output("psnr", VerifierOutput(broken, np.ones(4, bool)), 4)
    assert nonfinite.tolist() == [False, True, False, False] and out.scores[1].tolist() == [0] * 3


def test_runner_sums_per_frame_and_per_sample_scores_on_the_last_frame():
    batch = frame_batch(future=3)
    out = VerifierRunner(
        [{"name": "psnr", "weight": 1.0, "kwargs": {"aggregate": "per_frame"}},
         {"name": "mae", "weight": -10.0}]
    ).run(batch)  # fmt: skip
    psnr = get_verifier("psnr")(batch, aggregate="per_frame").scores
    mae = get_verifier("mae")(batch).scores
    assert out.scores.shape == (4, 3) and out.valid.all()
    np.testing.assert_allclose(out.scores[:, :2], psnr[:, :2])
    np.testing.assert_allclose(out.scores[:, 2], psnr[:, 2] - 10.0 * mae)
    np.testing.assert_allclose(out.verifier_scores["psnr"], psnr.sum(1))  # per sample, for @N
    flat = VerifierRunner([{"name": "psnr"}, {"name": "mae", "weight": -10.0}]).run(batch)
    assert flat.scores.shape == (4,)  # [B] verifiers alone: unchanged


def test_per_frame_scores_land_on_each_frames_last_token(interleaved):
    model, wm, windows, tokenizer = interleaved
    prompts = wm.encode_dataset(windows, "train")
    sampling = SamplingParams(seed=1, **wm.sampling_overrides())
    rollout = ModuleRollout(model, TEXT_LM, tokenizer).generate(prompts, sampling)
    cfg = load_config(["task=worldmodel_tokens"])
    b, f = len(rollout), wm.tokens.future
    per_frame = np.arange(1, b * f + 1, dtype=np.float64).reshape(b, f)
    scored, _ = apply_scores(rollout.clone(), VerifierOutput(per_frame, np.ones(b, bool)), cfg)
    tokens = scored["token_level_scores"]
    ends = torch.from_numpy(wm.tokens.frame_end_steps())
    assert ends.tolist() == [63, 63 + 4 + 64, 63 + 2 * (4 + 64)]  # frames of 64, gaps of 4
    assert torch.equal(tokens[:, ends], torch.from_numpy(per_frame).float())
    assert int((tokens != 0).sum()) == b * f
    # REINFORCE++/GAE returns see each frame's reward from where it occurs
    returns = algos.discounted_returns(tokens, rollout["response_mask"], gamma=1.0)
    assert torch.allclose(returns[:, 0], tokens.sum(1))
    assert torch.allclose(returns[:, ends[0] + 5], tokens[:, ends[1:]].sum(1))
    # a per-sample score sits on the last sampled token, not at mask.sum() - 1
    flat, _ = apply_scores(rollout.clone(), VerifierOutput(per_frame[:, 0], np.ones(b, bool)), cfg)
    last = wm.tokens.response_length - 1
    assert torch.equal(
        flat["token_level_scores"][:, last], torch.from_numpy(per_frame[:, 0]).float()
    )
    assert int((flat["token_level_scores"] != 0).sum()) == b


@pytest.mark.slow
def test_grpo_runs_on_interleaved_multistep_futures(tmp_path):
    """Pretraining (a few steps) and two GRPO steps with F=2 interleaved futures and per-frame
    rewards; the actor's log-probs match the rollout's on the sampled tokens."""
    pre = "++task.pretrain."
    cfg = load_config(
        run_overrides(
            tmp_path / "run",
            "task=worldmodel_tokens",
            f"task.cache_dir={tmp_path / 'cache'}",
            f"{pre}data.future=2",
            f"{pre}data.action_form=interleaved",
            f"{pre}data.train_trajectories=8",
            f"{pre}data.val_trajectories=4",
            f"{pre}data.test_trajectories=4",
            f"{pre}data.length=6",
            f"{pre}tokenizer.train.steps=4",
            f"{pre}tokenizer.train.batch_size=8",
            f"{pre}train.steps=4",
            f"{pre}train.val_every=2",
            f"{pre}train.val_windows=8",
            f"{pre}train.eval_windows=4",
            f"{pre}progress_bar=false",
            "task.val_windows=4",
            "task.eval.windows=4",
            "task.eval.samples=1",
            "task.report=false",
            "data.train_batch_size=4",
            "data.max_response_length=131",  # 2 frames of 64 + <action> A <frame>
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.rollout.n=2",
            "reward.verifiers=[{name: mae, weight: -1.0, kwargs: {aggregate: per_frame}}]",
            "trainer.total_steps=2",
            "trainer.test_freq=2",
            "trainer.seed=0",
        )
    )
    result = fit(cfg)
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    steps = [row for row in map(json.loads, lines) if "rollout/logprob_diff_max" in row]
    assert len(steps) == 2, result.summary
    assert_rollout_matches_actor(lambda key: [row[key] for row in steps])
    for row in steps:
        assert row["response_length/mean"] == 128  # forced actions carry no loss
    assert result.summary["worldmodel_eval"]["rl"]["greedy"]["valid"] == 1.0
