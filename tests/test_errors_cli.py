"""Expected errors print short at the CLI; everything else keeps its traceback."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from mmrl.errors import CheckpointError, ConfigError, DataError, MMRLError, VerifierError

REPO = Path(__file__).resolve().parents[1]


def mmrl_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """The real ``mmrl`` command line in a fresh process."""
    return subprocess.run(
        [sys.executable, "-m", "mmrl.trainer.cli", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
        timeout=300,
    )


def test_each_expected_error_is_an_mmrl_error_and_the_builtin_callers_catch():
    assert issubclass(ConfigError, ValueError) and issubclass(DataError, ValueError)
    assert issubclass(CheckpointError, FileNotFoundError)
    assert issubclass(VerifierError, ValueError)
    for cls in (ConfigError, DataError, CheckpointError, VerifierError):
        assert issubclass(cls, MMRLError)


def test_short_form_says_what_where_and_the_fix():
    err = DataError("frame 3 cannot be decoded", where="clip.mp4", fix="re-encode the file")
    assert err.short() == "clip.mp4: frame 3 cannot be decoded\n  fix: re-encode the file"
    assert str(err) == err.short()


def test_config_error_lists_every_problem():
    err = ConfigError(["rollout.n=0: must be >= 1", "actor.lr=-1: must be > 0"])
    assert err.problems == ["rollout.n=0: must be >= 1", "actor.lr=-1: must be > 0"]
    assert str(err).splitlines() == [
        "2 problems in the config:",
        "  - rollout.n=0: must be >= 1",
        "  - actor.lr=-1: must be > 0",
    ]


def test_errors_survive_pickling_with_a_rank_prefix():
    # Ray ships a worker's exception to the driver by pickling it.
    for err in (
        ConfigError(["a: bad", "b: bad"], fix="fix them"),
        CheckpointError("no config.json", where="/ckpt", fix="save it first"),
    ):
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is type(err) and back.short() == err.short()
        ranked = back.at("rank 1 of 2")
        assert type(ranked) is type(err)
        assert ranked.short().startswith("rank 1 of 2")


def test_cli_prints_a_config_error_in_one_line_without_traceback():
    out = mmrl_cli("train", "actor_rollout_ref.actor.no_such_key=1")
    assert out.returncode == 1
    assert "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert 1 <= len(lines) <= 2, out.stderr
    assert lines[0].startswith("mmrl: error:") and "no_such_key" in lines[0]


def test_cli_shows_the_traceback_with_debug():
    out = mmrl_cli("train", "actor_rollout_ref.actor.no_such_key=1", env={"MMRL_DEBUG": "1"})
    assert out.returncode != 0
    assert "Traceback" in out.stderr and "ConfigError" in out.stderr
    flag = mmrl_cli("--debug", "train", "actor_rollout_ref.actor.no_such_key=1")
    assert "Traceback" in flag.stderr and "ConfigError" in flag.stderr


def test_cli_keeps_the_traceback_of_an_unexpected_error(tmp_path):
    # A verifier plugin whose import fails with a ValueError is a bug in that code, not a
    # mistake in the config: the user needs the traceback.
    plugin = tmp_path / "broken_plugin.py"
    plugin.write_text("raise ValueError('internal bug in the plugin')\n")
    out = mmrl_cli(
        "train",
        "--dry-run",
        f"trainer.output_dir={tmp_path / 'run'}",
        f"reward.verifiers=[{{name: '{plugin}:score'}}]",
    )
    assert out.returncode != 0
    assert "Traceback" in out.stderr
    assert "ValueError: internal bug in the plugin" in out.stderr


@pytest.mark.parametrize("debug", ["0", ""])
def test_debug_off_values_keep_the_short_form(debug):
    out = mmrl_cli("train", "actor_rollout_ref.actor.no_such_key=1", env={"MMRL_DEBUG": debug})
    assert out.returncode == 1 and "Traceback" not in out.stderr
