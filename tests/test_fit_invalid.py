"""Runs whose verifiers fail on every sample: the step skips its update, the run goes on, and a
run that stays invalid stops with a checkpoint and a message naming the verifier."""

from __future__ import annotations

import json
import math
import textwrap

import pytest
import torch
from safetensors.torch import load_file

from mmrl.config import load_config
from mmrl.trainer.fit import fit
from mmrl.trainer.guard import InvalidRateError, zero_variance_mask
from mmrl.verifiers import VERIFIERS, register_verifier
from tests.conftest import run_overrides

NEEDS_VALID = ("critic/score/mean", "critic/advantages/mean", "actor/pg_loss", "actor/lr")


def _register(name, fn) -> None:
    if name not in VERIFIERS:
        register_verifier(name)(fn)


def always_raises(batch):
    raise RuntimeError("the judge is down")


def always_nan(batch):
    return [math.nan] * len(batch)


def fails_in_step_one(batch):
    """Raises for step 1's samples (uid "1-<prompt>"); scores 0/1 by prompt parity later."""
    if any(str(u).startswith("1-") for u in batch["uid"]):
        raise RuntimeError("cold start")
    return [float(int(str(u).split("-")[1]) % 2) for u in batch["uid"]]


def constant(batch):
    return [1.0] * len(batch)


for _fn in (always_raises, always_nan, fails_in_step_one, constant):
    _register(f"test_invalid_{_fn.__name__}", _fn)


def run(tmp_path, warm_model_dir, verifier: str, *extra: str):
    cfg = load_config(
        run_overrides(
            tmp_path,
            f"actor_rollout_ref.model.path={warm_model_dir}",
            "trainer.total_steps=2",
            "trainer.test_freq=0",
            "trainer.val_before_train=false",
            f"reward.verifiers=[{{name: '{verifier}', weight: 1.0}}]",
            *extra,
        )
    )
    return fit(cfg)


def actor_weights(path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


@pytest.mark.parametrize(
    ("verifier", "kind"),
    [("test_invalid_always_raises", "raise"), ("test_invalid_always_nan", "nonfinite")],
)
def test_all_invalid_steps_skip_the_update_and_the_run_finishes(
    tmp_path, warm_model_dir, verifier, kind, capsys
):
    # The console line and the progress bar are on: neither may need a missing metric.
    result = run(
        tmp_path, warm_model_dir, verifier, "trainer.loggers=[console,jsonl]",
        "trainer.progress_bar=true",
    )  # fmt: skip
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    name = verifier.split(":")[-1]
    for row in rows:
        assert row["reward/invalid_rate"] == 1.0 and row["actor/skipped_update"] == 1.0
        assert row[f"reward/{name}/errors/{kind}"] == 128
        for key in NEEDS_VALID + (f"reward/{name}/mean",):
            assert key not in row, key
    assert "step 2: reward/invalid_rate=1" in capsys.readouterr().out
    # No optimizer step: the saved actor is the starting model, bit for bit.
    start, end = actor_weights(warm_model_dir), actor_weights(result.output_dir / "actor")
    assert start.keys() == end.keys()
    assert all(torch.equal(start[k], end[k]) for k in start)


def test_skipped_step_does_not_advance_the_lr_schedule(tmp_path, warm_model_dir):
    result = run(
        tmp_path, warm_model_dir, "test_invalid_fails_in_step_one",
        "actor_rollout_ref.actor.lr=2e-4", "actor_rollout_ref.actor.lr_warmup_steps=4",
    )  # fmt: skip
    first, second = result.history
    assert first["actor/skipped_update"] == 1.0 and "actor/lr" not in first
    # Step 2 is the first update, so it runs at the first warm-up lr: 1/4 of 2e-4.
    assert second["actor/skipped_update"] == 0.0
    assert second["actor/lr"] == pytest.approx(0.5e-4)


def test_invalid_rate_over_the_limit_stops_the_run_with_a_checkpoint(tmp_path, warm_model_dir):
    with pytest.raises(InvalidRateError) as caught:
        run(
            tmp_path, warm_model_dir, "test_invalid_always_raises", "trainer.total_steps=5",
            "trainer.max_invalid_rate=0.5", "trainer.invalid_rate_patience=2",
        )  # fmt: skip
    message = str(caught.value)
    assert "'test_invalid_always_raises'" in message
    assert "RuntimeError: the judge is down" in message and "by raise" in message
    assert "trainer.max_invalid_rate=0.5" in message and "2 steps in a row" in message
    checkpoint = tmp_path / "global_step_2" / "actor"
    assert str(checkpoint) in message and (checkpoint / "model.safetensors").is_file()
    rows = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == 2  # the run stopped at step 2 of 5


def test_zero_variance_groups_keep_the_kl_update_unless_skipped(tmp_path, warm_model_dir):
    # Every sample scores 1: every group has zero variance and zero advantages.
    kept = run(tmp_path / "keep", warm_model_dir, "test_invalid_constant").history[-1]
    assert kept["actor/zero_variance_frac"] == 1.0 and kept["actor/skipped_update"] == 0.0
    assert kept["critic/advantages/max"] == kept["critic/advantages/min"] == 0.0
    assert kept["actor/kl_loss"] >= 0.0 and "actor/grad_norm" in kept  # verl: KL still applies
    skipped = run(
        tmp_path / "skip", warm_model_dir, "test_invalid_constant",
        "trainer.skip_zero_variance_updates=true",
    ).history[-1]  # fmt: skip
    assert skipped["actor/skipped_update"] == 1.0 and "actor/pg_loss" not in skipped
    assert skipped["critic/score/mean"] == 1.0  # the scores are valid, only the update is skipped


def test_zero_variance_mask_ignores_invalid_samples():
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 5.0])
    valid = torch.tensor([True, True, False, True, True, False])
    uids = ["a", "a", "a", "b", "b", "c"]
    # a: valid scores {1, 1} -> flat; b: {1, 0} -> not; c: no valid sample -> nothing to mark.
    expected = [True, True, False, False, False, False]
    assert zero_variance_mask(scores, valid, uids).tolist() == expected


HANGS = """
import time
from mmrl.verifiers import verifier

@verifier(mode="process", timeout_s=1.0)
def hangs(batch):
    time.sleep(3600)
"""


@pytest.mark.slow  # process-mode workers start in ~5-10 s, and every call waits for its timeout
def test_verifier_that_always_hangs_skips_updates_and_stops(tmp_path, warm_model_dir):
    plugin = tmp_path / "hanging.py"
    plugin.write_text(textwrap.dedent(HANGS))
    with pytest.raises(InvalidRateError, match=r"'hangs' failed most.*by timeout"):
        run(
            tmp_path / "run", warm_model_dir, f"{plugin}:hangs", "data.train_batch_size=2",
            "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "reward.num_workers=2", "trainer.total_steps=3", "trainer.invalid_rate_patience=2",
        )  # fmt: skip
    rows = [json.loads(r) for r in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["actor/skipped_update"] for r in rows] == [1.0, 1.0]
    assert all(r["reward/hangs/errors/timeout"] == 4 for r in rows)


def test_verifier_returning_the_wrong_length_stops_at_once(tmp_path, warm_model_dir):
    """Not one score per sample is a bug in the verifier, not an invalid sample."""
    _register("test_invalid_one_extra", lambda batch: [0.0] * (len(batch) + 1))
    with pytest.raises(ValueError, match=r"verifier 'test_invalid_one_extra' returned 129 scores"):
        run(tmp_path, warm_model_dir, "test_invalid_one_extra")
    assert (tmp_path / "metrics.jsonl").read_text() == ""
