"""Expected errors print short at the CLI; everything else keeps its traceback."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from mmrl.errors import CheckpointError, ConfigError, DataError, MMRLError, VerifierError
from mmrl.trainer.cli import main

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
    out = mmrl_cli("train", "actor_rollout_ref.actor.no_such_key=1", env={"MMRL_DEBUG": "0"})
    assert out.returncode == 1
    assert "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert 1 <= len(lines) <= 2, out.stderr
    assert lines[0].startswith("mmrl: error:") and "no_such_key" in lines[0]


def test_cli_shows_the_traceback_with_mmrl_debug():
    out = mmrl_cli("train", "actor_rollout_ref.actor.no_such_key=1", env={"MMRL_DEBUG": "1"})
    assert out.returncode != 0
    assert "Traceback" in out.stderr and "ConfigError" in out.stderr


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


def test_debug_flag_raises_the_error_itself(monkeypatch, capsys):
    monkeypatch.delenv("MMRL_DEBUG", raising=False)
    assert main(["train", "actor_rollout_ref.rollout.n=0"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("mmrl: error: actor_rollout_ref.rollout.n=0: must be >= 1")
    with pytest.raises(ConfigError, match="rollout.n=0"):
        main(["--debug", "train", "actor_rollout_ref.rollout.n=0"])


def test_dry_run_prints_the_config_and_every_problem(capsys):
    code = main(
        ["train", "--dry-run", "actor_rollout_ref.rollout.n=0", "trainer.mixed_precision=fp8"]
    )
    out = capsys.readouterr()
    assert code == 1
    assert "actor_rollout_ref:" in out.out and "loss_mode: vanilla" in out.out
    assert "2 problem(s) found" in out.err
    assert "rollout.n=0" in out.err and "mixed_precision='fp8'" in out.err
    assert main(["train", "--dry-run"]) == 0
    assert "is valid: no problems found" in capsys.readouterr().out


def test_a_damaged_prompt_video_is_a_data_error_naming_the_file(tmp_path):
    import numpy as np

    from mmrl.processors.media import read_video
    from mmrl.worldmodel.video import write_mp4

    frames = np.zeros((6, 32, 32, 3), np.uint8)
    data = write_mp4(tmp_path / "good.mp4", frames, fps=5).read_bytes()
    (tmp_path / "cut.mp4").write_bytes(data[: len(data) // 3])  # a truncated download
    (tmp_path / "text.mp4").write_text("not a video")
    for name in ("cut.mp4", "text.mp4"):  # a DataError: the CLI prints it in one line
        with pytest.raises(DataError, match=rf"{name}\) cannot be decoded, it is damaged"):
            read_video(str(tmp_path / name), fps=2.0, min_frames=2, max_frames=4)
