"""The run doctor: for each failure it detects, a real tiny run with that fault, and a healthy
run that gets no false alarm. Faulty verifiers are plugins written into the test's folder."""

from __future__ import annotations

import logging
import textwrap

import pytest

from mmrl.config import load_config
from mmrl.config.doctor import DoctorConfig
from mmrl.trainer.cli import main
from mmrl.trainer.doctor import check_worldmodel, diagnose
from mmrl.trainer.fit import fit
from tests.conftest import run_overrides

PLUGINS = '''
import time
import numpy as np
from mmrl.verifiers import VerifierOutput

def _exact(batch):
    pairs = zip(batch["response_text"], batch["ground_truth"], strict=True)
    return np.asarray([float(text.strip() == truth) for text, truth in pairs])

def length_only(batch):
    """Pays for length alone: tokens in the response over the longest possible."""
    mask = batch["response_mask"]
    return (mask.sum(-1).float() / mask.shape[1]).numpy()

CALLS = [0]

def flaky(batch):
    """A verifier backend that fails more each call (a sandbox filling its disk)."""
    CALLS[0] += 1
    fails = np.random.default_rng(CALLS[0]).random(len(batch)) < min(1.0, CALLS[0] / 10)
    return VerifierOutput(scores=_exact(batch), valid=~fails)

def slow(batch):
    time.sleep(4.0)  # longer than the old log-probs it overlaps, so it shows in timing_s/reward
    return _exact(batch)
'''


def plugin(tmp_path, name: str) -> str:
    path = tmp_path / "faulty_verifiers.py"
    path.write_text(textwrap.dedent(PLUGINS))
    return f"reward.verifiers=[{{name: '{path}:{name}'}}]"


def run(tmp_path, *extra: str, warm: str | None = None):
    model = [f"actor_rollout_ref.model.path={warm}"] if warm else []
    cfg = load_config(
        run_overrides(
            tmp_path / "run",
            *model,
            "trainer.test_freq=0",
            "trainer.val_before_train=false",
            *extra,
        )
    )
    return cfg, fit(cfg)


def checks(cfg, result) -> set[str]:
    return {f.check for f in diagnose(result.history, cfg.trainer.doctor)}


def test_healthy_run_gets_no_false_alarm(tmp_path, warm_model_dir, caplog):
    with caplog.at_level(logging.WARNING, logger="mmrl.trainer.doctor"):
        cfg, result = run(tmp_path, "trainer.total_steps=10", warm=warm_model_dir)
    assert checks(cfg, result) == set()
    assert result.history[0]["data/filtered_prompt_frac"] == 0.0
    assert "doctor:" not in caplog.text
    assert main(["doctor", str(tmp_path / "run")]) == 0


def test_prompts_dropped_for_length_are_named_first(tmp_path, warm_model_dir, caplog, capsys):
    """A prompt "a+b=" has 4 to 6 characters: a limit of 5 drops every problem whose operands
    both have two digits (about 64% for operands 0..49), which filter_overlong_prompts allows."""
    with caplog.at_level(logging.WARNING, logger="mmrl.trainer.doctor"):
        cfg, result = run(
            tmp_path,
            "trainer.total_steps=1",
            "data.max_prompt_length=5",
            "data.filter_overlong_prompts=true",
            warm=warm_model_dir,
        )
    (row,) = result.history  # no step 0 here: the training set's numbers are on step 1
    assert 0.5 < row["data/filtered_prompt_frac"] < 0.8 and row["data/filtered_prompts"] > 0
    first = diagnose(result.history, cfg.trainer.doctor)[0]
    assert (first.check, first.stage) == ("prompts dropped for length", "prompts")
    assert first.metric == "data/filtered_prompt_frac"
    assert "doctor: [prompts] prompts dropped for length" in caplog.text  # the live warning
    assert main(["doctor", str(tmp_path / "run")]) == 1
    out = capsys.readouterr().out
    assert "prompts dropped for length" in out and "data.max_prompt_length" in out
    relaxed = "trainer.doctor.max_overlong_prompt_frac=0.9"
    assert main(["doctor", str(tmp_path / "run"), relaxed]) == 0


def test_length_only_reward_is_named_length_bias(tmp_path, caplog, capsys):
    """An untrained policy (no SFT) answers at random lengths; the verifier pays for length."""
    with caplog.at_level(logging.WARNING, logger="mmrl.trainer.doctor"):
        cfg, result = run(
            tmp_path,
            "trainer.total_steps=6",
            "task.sft.steps=0",
            "reward.overlong_reward=keep",  # a clipped response keeps its (length) score
            plugin(tmp_path, "length_only"),
        )
    assert min(result.series("response_length/score_corr")) > 0.99
    assert "length bias" in checks(cfg, result)
    assert "doctor: [rewards] length bias" in caplog.text  # the live warning
    assert main(["doctor", str(tmp_path / "run")]) == 1
    out = capsys.readouterr().out
    assert "length bias" in out and "response_length/score_corr" in out


def test_length_reward_with_a_strict_validation_verifier_is_named_reward_hacking(tmp_path):
    """Training pays for length; validation scores answers (reward.val_verifiers): the
    training reward climbs while validation stays flat."""
    cfg, result = run(
        tmp_path,
        "trainer.total_steps=12",
        "trainer.test_freq=6",
        "trainer.val_before_train=true",
        "task.sft.steps=0",
        "task.val_size=32",
        "data.max_response_length=32",
        "reward.overlong_reward=keep",
        "actor_rollout_ref.actor.lr=3e-3",
        plugin(tmp_path, "length_only"),
        "reward.val_verifiers=[{name: exact_answer}]",
    )
    found = {f.check: f for f in diagnose(result.history, cfg.trainer.doctor)}
    hacking = found["training reward rises, validation does not"]
    assert hacking.stage == "rewards" and "reward hacking" in hacking.message
    assert "length bias" in found


def test_learning_rate_100x_is_named_kl_spike(tmp_path, warm_model_dir):
    cfg, result = run(
        tmp_path, "trainer.total_steps=4", "actor_rollout_ref.actor.lr=3e-2", warm=warm_model_dir
    )
    findings = diagnose(result.history, cfg.trainer.doctor)
    spike = [f for f in findings if f.check == "KL spike"]
    assert spike and spike[0].metric in ("actor/kl_loss", "actor/ppo_kl")
    assert "learning rate" in spike[0].message


def test_two_samples_per_prompt_with_uniform_answers_is_named_no_signal(tmp_path, warm_model_dir):
    """rollout.n=2 on the problems with operands 0..4, which the warm-started policy (trained
    on 0..49) answers the same way within nearly every pair."""
    cfg, result = run(
        tmp_path,
        "trainer.total_steps=5",
        "actor_rollout_ref.rollout.n=2",
        "task.max_operand=4",
        "task.val_size=4",
        warm=warm_model_dir,
    )
    assert "no learning signal in most groups" in checks(cfg, result)


def test_top_k_on_the_rollout_side_only_is_named_logprob_drift(tmp_path, warm_model_dir):
    """The transformers engine reports the log-probs of the top-k distribution it sampled
    from; the actor recomputes them over the whole vocabulary."""
    cfg, result = run(
        tmp_path,
        "trainer.total_steps=3",
        "actor_rollout_ref.rollout.top_k=2",
        warm=warm_model_dir,
    )
    assert "rollout log-probs drift" in checks(cfg, result)


def test_failing_verifier_is_named_rising_invalid_rate(tmp_path, warm_model_dir):
    cfg, result = run(
        tmp_path,
        "trainer.total_steps=10",
        "trainer.max_invalid_rate=null",
        plugin(tmp_path, "flaky"),
        warm=warm_model_dir,
    )
    assert "rising invalid-sample rate" in checks(cfg, result)


def test_slow_verifier_is_named_as_the_stage_over_its_share(tmp_path, warm_model_dir):
    cfg, result = run(
        tmp_path,
        "trainer.total_steps=3",
        "trainer.doctor.stage_shares={reward: 0.2}",
        plugin(tmp_path, "slow"),
        warm=warm_model_dir,
    )
    found = [f for f in diagnose(result.history, cfg.trainer.doctor) if f.stage == "timing"]
    assert [f.metric for f in found] == ["timing_s/reward"]
    assert "stage_shares.reward=0.2" in found[0].message


def test_worldmodel_repetition_and_error_growth_are_named():
    cfg = DoctorConfig()
    table = {
        "rl": {
            "greedy": {"repetition": 0.8, "mae@t1": 0.02, "mae@t2": 0.05, "mae@t3": 0.09},
            "sampled": {"repetition": 0.1, "mae@t1": 0.02, "mae@t2": 0.021, "mae@t3": 0.022},
        }
    }
    found = check_worldmodel(table, cfg)
    assert {(f.check, f.metric) for f in found} == {
        ("world model repeats its last frame", "worldmodel_eval.json rl/greedy/repetition"),
        ("error grows with the future step", "worldmodel_eval.json rl/greedy/mae@t1..t3"),
    }


def test_error_growth_is_named_from_the_evaluations_own_per_step_scores():
    """The world-model evaluation's own scoring (frame_scores, summarize_runs) of predictions
    whose noise grows with the future step (each frame fed its own errors) is named as drift;
    the same noise at every step is not."""
    import numpy as np

    from mmrl.tasks.worldmodel_eval import frame_scores, summarize_runs

    rng = np.random.default_rng(0)
    truth = rng.integers(40, 216, size=(16, 4, 32, 32, 3)).astype(np.uint8)
    valid = np.ones(16, dtype=bool)

    def rl_table(noise_per_step: list[float]) -> dict:
        noise = np.asarray(noise_per_step)[None, :, None, None, None]
        pred = np.clip(truth + rng.normal(0, 1, truth.shape) * noise, 0, 255).astype(np.uint8)
        scores = frame_scores(pred, truth, valid, None)
        return {"rl": {"greedy": summarize_runs([scores], pred).metrics}}

    growth = check_worldmodel(rl_table([6.0, 12.0, 18.0, 24.0]), DoctorConfig())
    assert [(f.check, f.metric) for f in growth] == [
        ("error grows with the future step", "worldmodel_eval.json rl/greedy/mae@t1..t4")
    ]
    assert check_worldmodel(rl_table([12.0] * 4), DoctorConfig()) == []


# Bench tier (CI's time budget): the default tier checks the same rule on recorded metrics
# (test_worldmodel_repetition_and_error_growth_are_named).
@pytest.mark.bench
def test_world_model_rewarded_for_standing_still_is_named_repetition(
    tmp_path, capsys, small_token_wm_cache
):
    """A real token world-model run whose reward pays for repeating the last frame
    (repetition_penalty with a negative weight) and whose validation predictions stand still
    where the truth moves (90% after 6 GRPO steps at this seed, against a threshold of 50%):
    `mmrl doctor` names the repetition, with the metric that shows it."""
    from tests.test_worldmodel_rl import small_pretraining

    cfg, result = run(
        tmp_path,
        "task=worldmodel_tokens",
        *small_pretraining(small_token_wm_cache),
        "task.val_windows=16",
        "task.eval.windows=16",
        "task.eval.samples=1",
        "task.report=false",
        "reward.verifiers=[{name: repetition_penalty, weight: -1.0}]",
        "trainer.total_steps=6",
        "trainer.test_freq=6",
        "trainer.seed=0",
    )
    rates = result.series("val/repetition_penalty/rate")
    assert rates[-1] > cfg.trainer.doctor.max_repetition, rates
    assert main(["doctor", str(tmp_path / "run")]) == 1
    printed = capsys.readouterr().out
    line = next(x for x in printed.splitlines() if "world model repeats its last frame" in x)
    assert "val/repetition_penalty/rate" in line


@pytest.mark.parametrize("override", ["trainer.doctor.window=1", "trainer.doctor.nope=1"])
def test_bad_thresholds_are_config_errors(tmp_path, override):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    assert main(["doctor", str(tmp_path), override]) == 1
