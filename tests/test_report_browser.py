"""The run report in a real browser: headless Chromium (Debian's ``chromium`` package, which
scripts/setup_env.sh installs for ``make test``) renders the report of a short real run.

No playwright: Chromium's own flags do what the test needs (``--screenshot``, ``--dump-dom``,
and ``--enable-logging=stderr`` which prints every console message of the page). The report
carries no script, so any console line from it is a failure; a control page with a
deliberate ``console.error`` proves the scan sees one.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from mmrl.config import load_config
from mmrl.trainer.fit import fit
from mmrl.trainer.report_plots import CURVES
from tests.conftest import run_overrides

pytestmark = pytest.mark.slow

FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--enable-logging=stderr",
    "--v=0",
)
CONSOLE = re.compile(r":CONSOLE[:(\]]")


def chromium() -> str:
    path = shutil.which("chromium")
    if path is None:
        pytest.fail(
            "chromium is not installed: `make test` installs it through scripts/setup_env.sh "
            "(apt-get install -y chromium); install it and run again"
        )
    return path


def render(page: Path, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """Chromium on ``page`` with a fresh profile; ``args``: --screenshot=..., --dump-dom."""
    profile = tmp_path / f"profile-{len(list(tmp_path.glob('profile-*')))}"
    profile.mkdir()
    cmd = [chromium(), *FLAGS, f"--user-data-dir={profile}", *args, page.as_uri()]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True)


def console_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if CONSOLE.search(line)]


def test_report_renders_with_charts_and_tables_and_no_console_error(tmp_path, warm_model_dir):
    run = tmp_path / "run"
    cfg = load_config(
        run_overrides(
            run, f"actor_rollout_ref.model.path={warm_model_dir}", "trainer.total_steps=3"
        )
    )
    fit(cfg)
    report = run / "report.html"

    control = tmp_path / "control.html"
    control.write_text("<!DOCTYPE html><p>x</p><script>console.error('deliberate')</script>")
    seen = render(control, tmp_path, "--dump-dom").stderr  # an action, so chromium exits
    assert any("deliberate" in line for line in console_lines(seen))

    shot = tmp_path / "report.png"
    done = render(report, tmp_path, "--window-size=1400,2600", f"--screenshot={shot}")
    assert console_lines(done.stderr) == []
    pixels = np.asarray(Image.open(shot).convert("L"), dtype=float)
    assert pixels.std() > 15 and (pixels < 200).mean() > 0.01  # drawn, not a blank page

    dom = render(report, tmp_path, "--dump-dom")
    assert console_lines(dom.stderr) == []
    charts = re.findall(r'<figure class="chart" data-chart="([^"]+)"', dom.stdout)
    assert set(charts) == {c.title for c in CURVES} | {"time per stage"}
    assert dom.stdout.count("<img") >= len(charts)
    assert '<table class="samples">' in dom.stdout and 'id="doctor"' in dom.stdout
    shutil.copy(shot, run / "report_screenshot.png")  # for a person to look at
