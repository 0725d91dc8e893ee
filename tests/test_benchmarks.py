"""The bench tier (`make bench`, never CI): every script under benchmarks/ runs with its
documented defaults and finishes cleanly."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p.stem for p in (ROOT / "benchmarks").glob("bench_*.py"))


def test_every_benchmark_is_a_bench_entry_point():
    """A new benchmarks/bench_*.py is picked up by `make bench` without editing this file."""
    assert len(SCRIPTS) >= 8 and "bench_text_grpo" in SCRIPTS


@pytest.mark.bench
@pytest.mark.parametrize("script", SCRIPTS)
def test_benchmark(script: str):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", f"benchmarks.{script}"], cwd=ROOT, env=env)
    assert proc.returncode == 0, f"benchmarks/{script}.py exited {proc.returncode}"


@pytest.mark.bench
def test_mutation_testing(tmp_path):
    """mutmut over the algorithm core, the actor update, dispatch and the verifier runner
    (docs/testing.md); its summary is printed. Needs the `mutation` extra."""
    if shutil.which("mutmut", path=str(Path(sys.executable).parent)) is None:
        pytest.fail('mutmut is not installed: pip install -e ".[mutation]"')
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    mutmut = str(Path(sys.executable).parent / "mutmut")
    proc = subprocess.run([mutmut, "run", "--max-children", "2"], cwd=ROOT, env=env)
    assert proc.returncode == 0
    subprocess.run([mutmut, "results"], cwd=ROOT, env=env, check=True)
