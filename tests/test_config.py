"""The run config: verl's shape, every problem found at once with its full key, generated docs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mmrl.config import load_config
from mmrl.config.docs import render
from mmrl.errors import ConfigError
from mmrl.trainer.preflight import VLLM_CPU_HEAD_SIZES, find_problems

REPO = Path(__file__).resolve().parents[1]


def problems_of(*overrides: str) -> list[str]:
    """Every problem the CLI would report for ``overrides`` (config fields and preflight)."""
    try:
        cfg = load_config(list(overrides), validate=False)
    except ConfigError as err:  # keys or types that do not fit the schema
        return err.problems
    return find_problems(cfg)


def assert_one_problem(overrides: list[str], *fragments: str) -> None:
    problems = problems_of(*overrides)
    assert len(problems) == 1, problems
    for fragment in fragments:
        assert fragment in problems[0], problems[0]


def test_the_default_config_has_no_problem():
    assert problems_of() == []


# --- one test per case that used to be accepted silently -------------------------------


def test_overlong_reward_must_be_keep_or_zero():
    assert_one_problem(["reward.overlong_reward=bogus"], "reward.overlong_reward", "keep, zero")


def test_rollout_name_must_be_a_registered_engine():
    assert_one_problem(
        ["actor_rollout_ref.rollout.name=bogus"],
        "actor_rollout_ref.rollout.name",
        "unknown rollout engine 'bogus'",
        "vllm",
    )


def test_kl_penalty_must_be_a_known_estimator():
    assert_one_problem(["algorithm.kl_penalty=k9"], "algorithm.kl_penalty", "low_var_kl")


def test_mixed_precision_must_be_auto_bf16_or_fp32():
    assert_one_problem(["trainer.mixed_precision=fp8"], "trainer.mixed_precision", "bf16")


def test_rollout_n_must_be_positive():
    assert_one_problem(["actor_rollout_ref.rollout.n=0"], "actor_rollout_ref.rollout.n=0", ">= 1")


def test_learning_rate_must_be_positive():
    assert_one_problem(["actor_rollout_ref.actor.lr=-1"], "actor_rollout_ref.actor.lr", "> 0")


def test_train_batch_must_split_into_whole_mini_batches():
    assert_one_problem(
        ["data.train_batch_size=5", "actor_rollout_ref.actor.ppo_mini_batch_size=2"],
        "data.train_batch_size=5",
        "ppo_mini_batch_size=2",
    )


def test_mini_batch_samples_must_divide_over_the_workers():
    assert_one_problem(
        [
            "trainer.n_workers_per_node=3",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "actor_rollout_ref.rollout.n=4",
        ],
        "do not divide over 3 workers",
    )


def test_every_problem_is_reported_at_once_with_its_full_key():
    problems = problems_of(
        "reward.overlong_reward=bogus",
        "actor_rollout_ref.rollout.name=bogus",
        "algorithm.kl_penalty=k9",
        "trainer.mixed_precision=fp8",
        "actor_rollout_ref.actor.lr=-1",
        "algorithm.adv_estimator=grpoo",
        "reward.verifiers=[{name: no_such_verifier}]",
    )
    keys = [p.split("=")[0].split(":")[0] for p in problems]
    assert sorted(keys) == sorted(
        [
            "reward.overlong_reward",
            "actor_rollout_ref.rollout.name",
            "algorithm.kl_penalty",
            "trainer.mixed_precision",
            "actor_rollout_ref.actor.lr",
            "algorithm.adv_estimator",
            "reward.verifiers[0].name",
        ]
    ), problems
    assert any("did you mean 'grpo'" in p for p in problems)


def test_load_config_raises_every_field_problem_together():
    with pytest.raises(ConfigError) as err:
        load_config(["actor_rollout_ref.rollout.n=0", "actor_rollout_ref.actor.lr=-1"])
    assert len(err.value.problems) == 2


# --- keys --------------------------------------------------------------------------------


def test_unknown_keys_name_the_closest_known_key():
    with pytest.raises(ConfigError) as err:
        load_config(["actor_rollout_ref.actor.lrr=1", "algorithm.adv_estimatr=rloo"])
    assert err.value.problems == [
        "actor_rollout_ref.actor.lrr: unknown key 'lrr' in actor_rollout_ref.actor; did you "
        "mean actor_rollout_ref.actor.lr?",
        "algorithm.adv_estimatr: unknown key 'adv_estimatr' in algorithm; did you mean "
        "algorithm.adv_estimator?",
    ]


def test_wrong_types_name_the_key():
    with pytest.raises(ConfigError, match=r"actor_rollout_ref\.actor\.lr='abc'"):
        load_config(["actor_rollout_ref.actor.lr=abc"])


def test_an_optional_bool_names_null_as_the_automatic_choice():
    with pytest.raises(ConfigError, match=r"enforce_eager='auto'.*expected true, false or null"):
        load_config(["actor_rollout_ref.rollout.enforce_eager=auto"])
    cfg = load_config(["actor_rollout_ref.rollout.enforce_eager=null"])
    assert cfg.actor_rollout_ref.rollout.enforce_eager is None


def test_the_old_policy_loss_spelling_names_the_new_key():
    with pytest.raises(ConfigError) as err:
        load_config(["actor_rollout_ref.actor.policy_loss=cispo"])
    assert "use actor_rollout_ref.actor.policy_loss.loss_mode=cispo" in str(err.value)


def test_policy_loss_knobs_sit_beside_the_loss_mode():
    cfg = load_config(
        [
            "actor_rollout_ref.actor.policy_loss.loss_mode=cispo",
            "actor_rollout_ref.actor.policy_loss.cispo_clip_ratio_high=2.0",
            "actor_rollout_ref.actor.policy_loss.gspo_loss_agg_mode=token-mean",
        ]
    )
    loss = cfg.actor_rollout_ref.actor.policy_loss
    assert (loss.loss_mode, loss.cispo_clip_ratio_high, loss.gspo_loss_agg_mode) == (
        "cispo",
        2.0,
        "token-mean",
    )
    assert_one_problem(
        ["actor_rollout_ref.actor.policy_loss.loss_mode=ppo2"], "unknown policy loss 'ppo2'"
    )
    assert_one_problem(
        ["actor_rollout_ref.actor.policy_loss.gspo_loss_agg_mode=sum"], "gspo_loss_agg_mode"
    )


def test_nested_task_keys_need_no_plus():
    cfg = load_config(["task=worldmodel_tokens", "task.pretrain.data.env=push"])
    assert cfg.task["pretrain"]["data"]["env"] == "push"
    assert_one_problem(
        ["task=worldmodel_tokens", "task.pretrain.data.env=pong"], "unknown environment 'pong'"
    )


def test_task_name_and_keys_are_checked():
    assert_one_problem(["task.name=text_additon"], "task.name", "did you mean 'text_addition'")
    assert_one_problem(["task.sft.stepz=1"], "task.sft.stepz", "did you mean task.sft.steps?")
    assert_one_problem(
        ["task=worldmodel_tokens", "task.pretrain.train.stepz=3"],
        "did you mean task.pretrain.train.steps?",
    )


# --- verifiers, paths, context, engine ----------------------------------------------------


def test_verifier_names_are_resolved_before_any_work(tmp_path):
    assert_one_problem(
        ["reward.verifiers=[{name: exact_answr}]"], "reward.verifiers[0].name", "not registered"
    )
    plugin = tmp_path / "my_verifiers.py"
    plugin.write_text("def score(batch):\n    return [1.0] * len(batch)\n")
    assert problems_of(f"reward.verifiers=[{{name: '{plugin}:score'}}]") == []
    assert_one_problem(
        [f"reward.verifiers=[{{name: '{tmp_path}/missing.py:score'}}]"], "does not exist"
    )


def save_model_config(path: Path, **fields) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    config = {"model_type": "qwen2", "max_position_embeddings": 32, "hidden_size": 64}
    (path / "config.json").write_text(json.dumps({**config, **fields}))
    return path


def test_model_path_must_be_a_local_model_folder(tmp_path):
    assert_one_problem(
        [f"actor_rollout_ref.model.path={tmp_path / 'nope'}"],
        "actor_rollout_ref.model.path",
        "is not a folder",
    )


def test_prompt_and_response_must_fit_the_model_context(tmp_path):
    model = save_model_config(tmp_path / "m", num_attention_heads=1)
    path = f"actor_rollout_ref.model.path={model}"
    assert problems_of(path, "data.max_prompt_length=16", "data.max_response_length=16") == []
    assert_one_problem(
        [path, "data.max_prompt_length=24", "data.max_response_length=16"],
        "40 tokens exceed the model's context of 32",
    )


def test_vllm_on_cpu_refuses_small_heads(tmp_path):
    model = save_model_config(tmp_path / "m", num_attention_heads=4)  # head_dim 16
    overrides = [f"actor_rollout_ref.model.path={model}", "trainer.device=cpu"]
    assert problems_of(*overrides) == []  # the hf engine has no such limit
    assert_one_problem([*overrides, "actor_rollout_ref.rollout.name=vllm"], "has 16")


def test_vllm_head_sizes_match_the_installed_vllm():
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    assert tuple(CPUAttentionBackend.get_supported_head_sizes()) == VLLM_CPU_HEAD_SIZES


def test_parquet_files_of_a_task_must_exist(tmp_path):
    assert_one_problem(
        ["task=vision_parquet", f"task.train_files=[{tmp_path / 'train.parquet'}]"],
        "task.train_files",
        "does not exist",
    )


# --- docs --------------------------------------------------------------------------------


def test_docs_config_md_is_generated_from_the_schema():
    current = (REPO / "docs" / "config.md").read_text()
    assert current == render(), "regenerate: python -m mmrl.config.docs > docs/config.md"


def test_every_field_is_documented():
    assert "|  |" not in render().replace("| `task` |", "")


def test_other_configs_keep_their_own_keys():
    # The run schema's key checks apply to `mmrl train` only; pretraining has its own schema.
    from mmrl.worldmodel.pretrain import load_pretrain_config

    cfg = load_pretrain_config(["data.env=push", "train.steps=5"])
    assert cfg.data.env == "push" and cfg.train.steps == 5
