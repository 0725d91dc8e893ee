"""Checkpoints: atomic saves, finding the latest, pruning, the state files, and a resumed
run that continues exactly (in-process; the killed-process tests are in
tests/test_resume_exact.py)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from mmrl.config import load_config
from mmrl.errors import CheckpointError, ConfigError
from mmrl.hybrid import fsdp
from mmrl.hybrid.state import (
    MODEL_FILE,
    OPTIMIZER_FILE,
    load_model_weights,
    load_optimizer,
    rng_state,
    save_optimizer,
    set_rng_state,
)
from mmrl.protocol import Batch
from mmrl.trainer import checkpoint as ckpt
from mmrl.trainer.fit import PromptLoader, RunResult, fit
from mmrl.trainer.preflight import find_problems
from mmrl.trainer.resume import check_config
from mmrl.trainer.tracking import Tracker
from tests.conftest import run_overrides

MACHINE = ("timing_s/", "perf/", "system/")


def comparable(history: list[dict]) -> dict[int, dict]:
    """Each step's metrics without machine measurements (times, memory, throughput)."""
    return {
        row["step"]: {k: v for k, v in row.items() if not any(m in k for m in MACHINE)}
        for row in history
    }


def write_dummy(folder: Path) -> None:
    for part in ("actor", "actor_optim"):
        (folder / part).mkdir()
        (folder / part / "weights.bin").write_bytes(b"x" * 64)
    (folder / ckpt.STATE_FILE).write_text("{}")
    (folder / ckpt.CONFIG_FILE).write_text("{}")


def test_a_save_publishes_the_folder_then_the_latest_marker(tmp_path):
    ckpt.save_atomically(tmp_path, 2, write_dummy)
    assert (tmp_path / ckpt.LATEST_FILE).read_text() == "2\n"
    assert ckpt.latest_checkpoint(tmp_path) == tmp_path / "global_step_2"
    assert not list(tmp_path.glob(".tmp*"))


def test_a_save_killed_between_write_and_rename_leaves_the_previous_latest(tmp_path):
    ckpt.save_atomically(tmp_path, 2, write_dummy)
    script = (  # a light process: the save machinery alone
        "import sys; from pathlib import Path;"
        "from mmrl.trainer.checkpoint import save_atomically;"
        "save_atomically(Path(sys.argv[1]), 4, lambda f: (f / 'actor').mkdir())"
    )
    env = {**os.environ, ckpt.KILL_ENV: "save:after_write:4"}
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path)], env=env)
    assert proc.returncode == -9  # SIGKILL at the hook
    assert (tmp_path / ".tmp_global_step_4" / "actor").is_dir()  # written, never published
    assert not (tmp_path / "global_step_4").exists()
    assert ckpt.latest_checkpoint(tmp_path) == tmp_path / "global_step_2"
    ckpt.save_atomically(tmp_path, 4, write_dummy)  # the next save clears the leftover
    assert not list(tmp_path.glob(".tmp*"))
    assert ckpt.latest_checkpoint(tmp_path) == tmp_path / "global_step_4"


def test_latest_marker_problems_are_checkpoint_errors(tmp_path):
    assert ckpt.latest_checkpoint(tmp_path) is None
    (tmp_path / ckpt.LATEST_FILE).write_text("two")
    with pytest.raises(CheckpointError, match="not a step number"):
        ckpt.latest_checkpoint(tmp_path)
    (tmp_path / ckpt.LATEST_FILE).write_text("3")
    (tmp_path / "global_step_3" / "actor").mkdir(parents=True)
    with pytest.raises(CheckpointError, match="global_step_3 is not a complete checkpoint"):
        ckpt.latest_checkpoint(tmp_path)


def test_prune_keeps_the_newest(tmp_path):
    for step in (2, 10, 4, 8):
        ckpt.save_atomically(tmp_path, step, write_dummy)
    gone = ckpt.prune(tmp_path, keep=2)
    assert sorted(p.name for p in gone) == ["global_step_2", "global_step_4"]
    assert sorted(p.name for p in tmp_path.glob("global_step_*")) == [
        "global_step_10",
        "global_step_8",
    ]
    assert ckpt.prune(tmp_path, keep=None) == []


def test_a_changed_config_is_refused_naming_the_key():
    saved = {"trainer": {"total_steps": 10, "seed": 0}, "actor_rollout_ref": {"actor": {"lr": 1}}}
    longer = {"trainer": {"total_steps": 20, "seed": 0}, "actor_rollout_ref": {"actor": {"lr": 1}}}
    check_config(saved, longer, Path("global_step_4"))  # total_steps may change
    other = {"trainer": {"total_steps": 10, "seed": 0}, "actor_rollout_ref": {"actor": {"lr": 2}}}
    with pytest.raises(ConfigError, match=r"actor_rollout_ref\.actor\.lr: 1 in global_step_4, 2"):
        check_config(saved, other, Path("global_step_4"))


def test_tracker_resumes_by_dropping_later_lines(tmp_path):
    lines = [json.dumps({"step": s, "x": s}) for s in range(5)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 5, "x"')  # torn
    tracker = Tracker(tmp_path, ["jsonl"], resume_step=2)
    assert [r["step"] for r in tracker.history] == [0, 1, 2]
    tracker.log({"x": 3.5}, 3)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["x"]) for r in rows] == [(0, 0), (1, 1), (2, 2), (3, 3.5)]


def test_prompt_loader_continues_its_order_and_shuffles(tmp_path):
    prompts = Batch.from_dict({"x": torch.arange(10)})
    a = PromptLoader(prompts, 4, shuffle=True, seed=3)
    for _ in range(2):
        a.next()
    state = json.loads(json.dumps(a.state_dict()))
    b = PromptLoader(prompts, 4, shuffle=True, seed=99)
    b.load_state_dict(state)
    for _ in range(5):  # across passes: the reshuffle draws from the restored RNG
        assert torch.equal(a.next()["x"], b.next()["x"])
    with pytest.raises(CheckpointError, match="covers 10 prompts"):
        PromptLoader(Batch.from_dict({"x": torch.arange(12)}), 4, True, 0).load_state_dict(state)


def test_rng_state_round_trips_through_json():
    state = json.loads(json.dumps(rng_state()))
    draws = (random.random(), float(np.random.rand()), float(torch.rand(())))
    set_rng_state(state)
    assert (random.random(), float(np.random.rand()), float(torch.rand(()))) == draws


def test_optimizer_state_round_trips_bit_for_bit(tmp_path, tiny_lm_dirs):
    fsdp.init_process_group(0, 1, "cpu", timeout_s=60)

    def build(lr_steps: int):
        model = fsdp.shard_model(AutoModelForCausalLM.from_pretrained(tiny_lm_dirs["untied"]), None)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))
        return model, opt, sched

    def train_step(model, opt, sched, seed):
        ids = torch.randint(0, 8, (2, 6), generator=torch.Generator().manual_seed(seed))
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()

    model, opt, sched = build(0)
    for seed in range(2):
        train_step(model, opt, sched, seed)
    save_optimizer(model, opt, sched, tmp_path)
    weights = fsdp.full_state_dict(model, on_every_rank=False)
    fresh, fresh_opt, fresh_sched = build(0)
    load_model_weights(fresh, weights)
    load_optimizer(fresh, fresh_opt, fresh_sched, tmp_path)
    assert fresh_sched.last_epoch == sched.last_epoch == 2
    assert fresh_opt.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    train_step(model, opt, sched, 7)
    train_step(fresh, fresh_opt, fresh_sched, 7)
    after = fsdp.full_state_dict(model, on_every_rank=False)
    for name, value in fsdp.full_state_dict(fresh, on_every_rank=False).items():
        assert torch.equal(value, after[name]), name


def short_run(out: Path, model_dir: Path, steps: int, *extra: str) -> RunResult:
    """A text run of ``steps`` steps that validates and saves every second step."""
    cfg = load_config(
        run_overrides(
            out,
            f"actor_rollout_ref.model.path={model_dir}",
            f"trainer.total_steps={steps}",
            "trainer.save_freq=2",
            "trainer.test_freq=2",
            "data.train_batch_size=4",
            "actor_rollout_ref.rollout.n=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2",  # two optimizer steps a step
            "task.val_size=8",
            *extra,
        )
    )
    return fit(cfg)


def test_a_resumed_run_continues_exactly(tmp_path, warm_model_dir):
    """Two steps, then the same run extended to four: steps 3-4 equal a four-step run's."""

    def run(out: Path, steps: int, *extra: str) -> RunResult:
        return short_run(out, warm_model_dir, steps, *extra)

    full = run(tmp_path / "full", 4)
    run(tmp_path / "split", 2)
    resumed = run(tmp_path / "split", 4)
    assert sorted(p.name for p in (tmp_path / "split").glob("global_step_*")) == [
        "global_step_2",
        "global_step_4",
    ]
    assert [r["step"] for r in resumed.history] == [0, 1, 2, 3, 4]
    assert comparable(resumed.history) == comparable(full.history)
    assert comparable(ckpt_lines(tmp_path / "split")) == comparable(full.history)
    final = AutoModelForCausalLM.from_pretrained(tmp_path / "split" / "global_step_4" / "actor")
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "full" / "actor")
    expected = reference.state_dict()
    for name, value in final.state_dict().items():
        assert torch.equal(value, expected[name]), name
    refused = r"actor_rollout_ref\.actor\.lr: 0.0003 in global_step_4, 2e-05 now"
    with pytest.raises(ConfigError, match=refused):
        run(tmp_path / "split", 6, "actor_rollout_ref.actor.lr=2e-5")


def test_a_resumed_gae_run_continues_with_its_critic(tmp_path, warm_model_dir):
    """GAE: the critic's weights and AdamW moments are in the checkpoint and loaded, so the
    value loss and values of the steps after a resume equal an uninterrupted run's."""
    gae = ("algorithm.adv_estimator=gae", "trainer.test_freq=0")
    full = short_run(tmp_path / "full", warm_model_dir, 4, *gae)
    short_run(tmp_path / "split", warm_model_dir, 2, *gae)
    saved = tmp_path / "split" / "global_step_2" / "critic"
    assert (saved / MODEL_FILE).is_file() and (saved / OPTIMIZER_FILE).is_file()
    resumed = short_run(tmp_path / "split", warm_model_dir, 4, *gae)
    after, expected = comparable(resumed.history), comparable(full.history)
    for step in (3, 4):
        assert "critic/vf_loss" in expected[step] and "critic/values/mean" in expected[step]
        assert after[step] == expected[step], step
    # The critic learned, so a critic that restarted fresh (or lost its moments) would show.
    assert expected[3]["critic/vf_loss"] != expected[1]["critic/vf_loss"]


def ckpt_lines(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_resume_path_problems_are_found_before_any_work(tmp_path):
    cfg = load_config(["trainer.resume_mode=resume_path"], validate=False)
    assert any("set trainer.resume_from_path=" in p for p in find_problems(cfg))
    missing = tmp_path / "global_step_3"
    cfg = load_config(
        ["trainer.resume_mode=resume_path", f"trainer.resume_from_path={missing}"], validate=False
    )
    assert f"trainer.resume_from_path={missing}: does not exist" in find_problems(cfg)
