"""The wheel a user gets from `pip install mmrl`: built from this tree, installed into a fresh
virtual environment, run from a folder outside the repository.

The fresh environment reuses this one's installed dependencies (a path entry to its
site-packages) so nothing is downloaded, but not its editable mmrl: that is installed by a
``.pth`` hook, which a path entry does not run.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def run(cmd: list[str], cwd: Path, timeout: float = 600) -> str:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["TOKENIZERS_PARALLELISM"] = "false"
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("wheel")
    # Built from a copy: setuptools leaves build/ and *.egg-info beside the sources.
    src = tmp / "src"
    shutil.copytree(ROOT / "mmrl", src / "mmrl", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--wheel-dir",
            str(tmp / "dist"),
            str(src),
        ],
        cwd=tmp,
    )
    (wheel,) = (tmp / "dist").glob("mmrl-*.whl")
    env_dir = tmp / "env"
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    site = Path(
        run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            cwd=tmp,
        ).strip()
    )
    (site / "shared_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "--no-deps",
            "--no-index",
            str(wheel),
        ],
        cwd=tmp,
    )
    outside = tmp / "elsewhere"
    outside.mkdir()
    return {"wheel": wheel, "python": python, "mmrl": env_dir / "bin" / "mmrl", "cwd": outside}


def test_the_wheel_ships_the_configs(installed):
    import zipfile

    names = zipfile.ZipFile(installed["wheel"]).namelist()
    assert "mmrl/configs/train.yaml" in names
    assert "mmrl/configs/task/worldmodel_tokens_demo.yaml" in names
    assert "mmrl/configs/examples/qwen2_5_vl_7b_instruct_config.json" in names
    where = run(
        [str(installed["python"]), "-c", "import mmrl, mmrl.config as c; print(c.config_dir())"],
        cwd=installed["cwd"],
    ).strip()
    assert Path(where).is_relative_to(installed["python"].parents[1]), where
    assert not Path(where).is_relative_to(ROOT)


def test_the_installed_command_trains_from_outside_the_repository(installed):
    mmrl, cwd = str(installed["mmrl"]), installed["cwd"]
    assert "--config-name" in run([mmrl, "train", "--help"], cwd)
    out = run([mmrl, "train", "--dry-run", "algorithm.adv_estimator=rloo"], cwd)
    assert "adv_estimator: rloo" in out and "is valid" in out
    out = run([mmrl, "train", "--dry-run", "--config-name", "examples/worldmodel_tokens_gpu"], cwd)
    assert "is valid" in out
    run(
        [
            mmrl,
            "train",
            "trainer.output_dir=run",
            "trainer.total_steps=2",
            "trainer.test_freq=0",
            "trainer.progress_bar=false",
            "task.sft.steps=5",
            "task.val_size=16",
        ],
        cwd,
    )
    rows = [json.loads(line) for line in (cwd / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["step"] > 0] == [1, 2]
    assert (cwd / "run" / "actor" / "model.safetensors").exists()
