"""End-to-end behaviour of the fit loop on the synthetic addition task."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from mmrl.config import load_config
from mmrl.processors import PromptTooLongError
from mmrl.tasks import get_task
from mmrl.trainer.fit import fit
from mmrl.verifiers import VERIFIERS, register_verifier
from tests.conftest import assert_rollout_matches_actor, run_overrides
from tests.paired import greedy_text_scores, paired_gain

# Wall-clock and process measurements (memory, fds, threads) are not functions of the seed.
MACHINE_KEYS = ("timing_s/", "perf/", "system/")


def short_run(tmp_path, warm_model_dir, *extra: str):
    cfg = load_config(
        run_overrides(
            tmp_path,
            f"actor_rollout_ref.model.path={warm_model_dir}",
            "trainer.total_steps=2",
            "trainer.test_freq=0",
            "trainer.val_before_train=false",
            *extra,
        )
    )
    return fit(cfg)


def test_grpo_beats_its_warm_start_on_a_test_split(tmp_path):
    """The README's default run, shortened: SFT warm-up then 30 GRPO steps. The warm-up model
    and the RL actor answer the same 512 test problems (held out from training and
    validation) greedily; RL must win by at least 3 standard errors of the paired
    difference."""
    cfg = load_config(
        run_overrides(
            tmp_path, "trainer.total_steps=30", "trainer.test_freq=10", "task.test_size=512"
        )
    )
    result = fit(cfg)
    assert len(result.series("val/score/mean")) == 4
    assert_rollout_matches_actor(result.series, cfg.trainer.mixed_precision)
    test = get_task("text_addition")(cfg.task).build_data(cfg.trainer.seed).test
    base = greedy_text_scores(tmp_path / "init_model", cfg, test)
    rl = greedy_text_scores(tmp_path / "actor", cfg, test)
    gain, se = paired_gain(base, rl, "text GRPO, greedy, test split")
    assert gain > 0 and gain >= 3 * se, (gain, se)


@pytest.mark.parametrize(
    "estimator",
    ["grpo", "gdpo", "gae", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax"],
)
def test_every_estimator_runs_a_step(tmp_path, warm_model_dir, estimator):
    result = short_run(tmp_path, warm_model_dir, f"algorithm.adv_estimator={estimator}")
    row = result.history[-1]
    assert np.isfinite(row["actor/pg_loss"]) and np.isfinite(row["actor/grad_norm"])
    assert (
        row["critic/advantages/max"] > row["critic/advantages/min"]
    )  # some signal reached the loss
    if estimator == "gae":
        assert "critic/vf_loss" in row and "critic/values/mean" in row


@pytest.mark.parametrize("loss", ["vanilla", "gspo", "cispo"])
def test_every_policy_loss_runs_a_step(tmp_path, warm_model_dir, loss):
    row = short_run(
        tmp_path, warm_model_dir, f"actor_rollout_ref.actor.policy_loss.loss_mode={loss}"
    ).history[-1]
    assert np.isfinite(row["actor/pg_loss"]) and 0.0 <= row["actor/pg_clipfrac"] <= 1.0


def test_kl_in_reward_with_adaptive_controller(tmp_path, warm_model_dir):
    row = short_run(
        tmp_path,
        warm_model_dir,
        "algorithm.use_kl_in_reward=true",
        "algorithm.kl_ctrl.type=adaptive",
        "actor_rollout_ref.actor.use_kl_loss=false",
    ).history[-1]
    assert "actor/reward_kl_penalty" in row and "actor/kl_loss" not in row


def test_truncated_importance_sampling_is_logged(tmp_path, warm_model_dir):
    row = short_run(
        tmp_path, warm_model_dir, "algorithm.rollout_is=token", "algorithm.rollout_is_cap=1.5"
    ).history[-1]
    # The transformers engine samples with the trainer's own numerics: the weights are ~1.
    assert row["rollout_is/mean"] == pytest.approx(1.0, abs=1e-3) and row["rollout_is/max"] <= 1.5


def test_lr_warmup_rises_once_per_rl_step(tmp_path, warm_model_dir):
    result = short_run(
        tmp_path,
        warm_model_dir,
        "actor_rollout_ref.actor.lr=2e-4",
        "actor_rollout_ref.actor.lr_warmup_steps=4",
    )
    assert result.series("actor/lr") == pytest.approx([0.5e-4, 1e-4])


def test_same_seed_same_metrics(tmp_path, warm_model_dir):
    def metrics(run_dir):
        hist = short_run(run_dir, warm_model_dir, "trainer.seed=3").history
        return [{k: v for k, v in row.items() if not k.startswith(MACHINE_KEYS)} for row in hist]

    first, second = metrics(tmp_path / "a"), metrics(tmp_path / "b")
    assert first == second
    other = short_run(tmp_path / "c", warm_model_dir, "trainer.seed=4").history[-1]
    assert (
        other["critic/score/mean"] != first[-1]["critic/score/mean"]
        or other["actor/pg_loss"] != first[-1]["actor/pg_loss"]
    )


def test_metrics_jsonl_and_saved_actor(tmp_path, warm_model_dir):
    result = short_run(tmp_path, warm_model_dir, "trainer.loggers=[jsonl,console]")
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for key in (
        "timing_s/gen",
        "timing_s/update_actor",
        "actor/pg_clipfrac",
        "actor/ppo_kl",
        "critic/score/mean",
        "response_length/mean",
        "response_length/clip_ratio",
        "perf/throughput",
        "perf/rollout_tokens_per_s",
    ):
        assert key in rows[-1], key
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["peak_memory_gib"] > 0 and summary["wall_time_s"] > 0
    # The trained actor is a plain save_pretrained directory that transformers loads and runs.
    actor = result.output_dir / "actor"
    model = AutoModelForCausalLM.from_pretrained(actor, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(actor, local_files_only=True)
    ids = tok("12+30=", return_tensors="pt", add_special_tokens=False)["input_ids"]
    out = model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape[1] > ids.shape[1]
    trained = dict(model.named_parameters())
    init = AutoModelForCausalLM.from_pretrained(warm_model_dir, local_files_only=True)
    assert any(not torch.equal(p, trained[n]) for n, p in init.named_parameters()), (
        "actor did not change"
    )


def test_overlong_responses_counted_and_zeroed(tmp_path, warm_model_dir):
    # One token is not enough for "answer + EOS": almost every response is cut (a sampled
    # EOS as the first token is an empty, uncut answer, which is rare after the warm-up).
    zero = short_run(tmp_path / "z", warm_model_dir, "data.max_response_length=1").history[-1]
    assert zero["response_length/clip_ratio"] > 0.9
    assert zero["critic/score/mean"] == 0.0  # cut answers score zero, empty ones are wrong
    keep = short_run(
        tmp_path / "k", warm_model_dir, "data.max_response_length=1", "reward.overlong_reward=keep"
    )
    assert keep.history[-1]["response_length/clip_ratio"] > 0.9


def test_prompt_longer_than_max_names_the_sample(tmp_path, warm_model_dir):
    with pytest.raises(
        PromptTooLongError, match=r"sample \d+: prompt has \d+ tokens.*max_prompt_length=3"
    ):
        short_run(tmp_path, warm_model_dir, "data.max_prompt_length=3")


def test_overlong_prompts_filtered_when_asked(tmp_path, warm_model_dir):
    # "a+b=" has 4 to 6 characters: a limit of 5 drops the longest prompts and counts them.
    cfg = load_config(
        run_overrides(
            tmp_path,
            f"actor_rollout_ref.model.path={warm_model_dir}",
            "data.max_prompt_length=5",
            "data.filter_overlong_prompts=true",
            "trainer.total_steps=1",
            "trainer.test_freq=0",
        )
    )
    row0 = fit(cfg).history[0]
    assert row0["data/filtered_prompts"] > 0


def test_empty_dataset_is_a_clear_error(tmp_path, warm_model_dir):
    with pytest.raises(ValueError, match="train dataset is empty"):
        short_run(tmp_path, warm_model_dir, "task.train_size=0")


def test_verifier_with_wrong_count_names_itself(tmp_path, warm_model_dir):
    if "returns_one_score" not in VERIFIERS:
        register_verifier("returns_one_score")(lambda batch: [1.0])
    with pytest.raises(
        ValueError, match=r"verifier 'returns_one_score' returned 1 scores .* batch of 128"
    ):
        short_run(
            tmp_path, warm_model_dir, "reward.verifiers=[{name: returns_one_score, weight: 1.0}]"
        )


def test_grpo_with_one_sample_per_prompt_warns(tmp_path, warm_model_dir):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        short_run(tmp_path, warm_model_dir, "actor_rollout_ref.rollout.n=1")
    assert any("every advantage is zero" in str(w.message) for w in caught)


def test_unknown_override_is_rejected(tmp_path):
    with pytest.raises(Exception, match="nonexistent"):
        load_config(run_overrides(tmp_path, "+actor_rollout_ref.actor.nonexistent=1"))


def test_cli_train_accepts_overrides(tmp_path, warm_model_dir):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mmrl.trainer.cli",
            "train",
            *run_overrides(tmp_path),
            f"actor_rollout_ref.model.path={warm_model_dir}",
            "algorithm.adv_estimator=rloo",
            "trainer.total_steps=2",
            "trainer.test_freq=2",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "held-out score" in proc.stdout and "peak memory" in proc.stdout
    assert (tmp_path / "actor" / "config.json").is_file()


def test_mid_run_checkpoints_load_and_hold_that_step(tmp_path, warm_model_dir):
    short_run(tmp_path, warm_model_dir, "trainer.save_freq=1")
    mid = AutoModelForCausalLM.from_pretrained(tmp_path / "global_step_1" / "actor")
    final = AutoModelForCausalLM.from_pretrained(tmp_path / "actor")
    warm = AutoModelForCausalLM.from_pretrained(warm_model_dir)
    assert (tmp_path / "global_step_2" / "actor").is_dir()  # the last step is saved too
    name = "lm_head.weight"
    weights = [dict(m.named_parameters())[name] for m in (warm, mid, final)]
    assert not torch.equal(weights[0], weights[1]) and not torch.equal(weights[1], weights[2])


def test_several_nodes_without_a_cluster_address_is_a_clear_error(tmp_path, warm_model_dir):
    with pytest.raises(ValueError, match="nnodes=2 needs a running Ray cluster"):
        short_run(tmp_path / "a", warm_model_dir, "trainer.nnodes=2")
    # No workers at all is a config value out of range, found when the config is loaded.
    with pytest.raises(ValueError, match="trainer.n_workers_per_node=0: must be >= 1"):
        short_run(tmp_path / "b", warm_model_dir, "trainer.n_workers_per_node=0")
