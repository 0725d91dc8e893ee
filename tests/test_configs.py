"""Every YAML file under mmrl/configs/ composes and validates, and the package ships them."""

from __future__ import annotations

from pathlib import Path

import pytest

from mmrl.config import config_dir, load_config
from mmrl.tasks import get_task
from mmrl.worldmodel.pretrain import load_pretrain_config

# Overrides a config needs before it validates: its `???` fields, given as a user would.
REQUIRED = {
    "examples/qwen2_5_vl_7b_gpu": [
        "actor_rollout_ref.model.path=/models/Qwen2.5-VL-7B-Instruct",
        "task.train_files=[/data/geo3k/train.parquet]",
    ],
    "task/vision_parquet": ["task.train_files=[/data/train.parquet]"],
    "task/worldmodel_videos": ["task.pretrain.data.videos=/data/my_recordings"],
    "task/worldmodel_latent_videos": ["task.data.videos=/data/my_recordings"],
    "task/worldmodel_flow_videos": ["task.data.videos=/data/my_recordings"],
}


def all_configs() -> list[str]:
    root = config_dir()
    return sorted(str(p.relative_to(root).with_suffix("")) for p in root.rglob("*.yaml"))


def test_configs_live_inside_the_package():
    import mmrl

    root = config_dir()
    assert root == Path(mmrl.__file__).parent / "configs"
    assert (root / "train.yaml").is_file()
    assert {"train", "task/text_addition", "worldmodel/pretrain"} <= set(all_configs())


@pytest.mark.parametrize("name", all_configs())
def test_every_config_composes_and_validates(name: str):
    """A config that composes but names an unknown field, task or verifier fails here."""
    group = name.split("/")[0] if "/" in name else ""
    if group == "worldmodel":
        cfg = load_pretrain_config()
        assert cfg.train.steps > 0 and cfg.data.future >= 1
        return
    if group == "task":
        cfg = load_config([f"task={name.split('/', 1)[1]}", *REQUIRED.get(name, [])])
    elif group in ("", "examples"):
        cfg = load_config(REQUIRED.get(name, []), config_name=name)
    else:
        raise AssertionError(f"{name}: a new config folder; teach this test to compose it")
    # The task's own schema rejects unknown or mistyped task keys (tasks.base.task_config).
    task = get_task(cfg.task["name"])(cfg.task)
    assert task.name == cfg.task["name"]
    from mmrl.verifiers import get_verifier

    for v in cfg.reward.verifiers:
        assert get_verifier(v.name) is not None


def test_the_demo_config_is_the_token_recipe_with_small_budgets():
    cfg = load_config(["task=worldmodel_tokens_demo"])
    full = load_config(["task=worldmodel_tokens"])
    assert cfg.task["name"] == "worldmodel_tokens"
    assert cfg.trainer.total_steps < full.trainer.total_steps
    assert cfg.task["pretrain"]["train"]["steps"] < full.task["pretrain"]["train"].get(
        "steps", 10**9
    )


def test_train_dry_run_validates_prints_and_trains_nothing(tmp_path, capsys):
    from mmrl.trainer.cli import main

    out_dir = tmp_path / "run"
    assert (
        main(
            ["train", "--dry-run", "algorithm.adv_estimator=rloo", f"trainer.output_dir={out_dir}"]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "adv_estimator: rloo" in out and "is valid" in out
    assert not out_dir.exists()
    assert main(["train", "--dry-run", "--config-name", "examples/worldmodel_tokens_gpu"]) == 0
    assert "name: vllm" in capsys.readouterr().out  # the example's rollout engine
    assert main(["train", "--dry-run", "task.bogus=1"]) == 1  # every problem, one line each
    assert "task.bogus" in capsys.readouterr().err
