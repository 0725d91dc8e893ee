"""The run report (``report.html``): written by every run, also a crashed one, and rebuilt by
``mmrl report RUN_DIR``. These are the structural checks; tests/test_report_browser.py renders
it in a real browser (slow tier)."""

from __future__ import annotations

import base64
import io
import json
from html.parser import HTMLParser

import numpy as np
import pytest
import torch
from PIL import Image

from mmrl.config import load_config
from mmrl.errors import VerifierError
from mmrl.protocol import Batch
from mmrl.tasks.visual_counting import VisualCountingConfig, make_counting_dataset
from mmrl.trainer.cli import main
from mmrl.trainer.fit import fit
from mmrl.trainer.report import write_report
from mmrl.trainer.report_plots import CURVES
from mmrl.trainer.samples import SampleLog, read_samples
from tests.conftest import run_overrides


class Page(HTMLParser):
    """The parts of a report a reader sees: charts, images, tables, findings, sections."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.charts, self.images, self.sections, self.tags = [], [], [], []
        self.table_rows: dict[str, int] = {}
        self.table = None
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.tags.append(tag)
        if tag == "figure":
            self.charts.append(attrs.get("data-chart"))
        elif tag == "img":
            self.images.append(attrs["src"])
        elif tag == "section":
            self.sections.append(attrs.get("id"))
        elif tag == "table":
            self.table = attrs.get("class")
        elif tag == "tr" and self.table:
            self.table_rows[self.table] = self.table_rows.get(self.table, 0) + 1


def decoded_images(page: Page) -> list[Image.Image]:
    out = []
    for src in page.images:
        head, data = src.split(",", 1)
        assert head in ("data:image/png;base64", "data:image/gif;base64"), head
        out.append(Image.open(io.BytesIO(base64.b64decode(data))))
    return out


def assert_self_contained(text: str) -> None:
    assert "<script" not in text  # nothing to run, nothing to fail in a browser
    assert "http://" not in text and "https://" not in text and "file:" not in text


@pytest.fixture(scope="module")
def short_run_dir(tmp_path_factory, warm_model_dir):
    out = tmp_path_factory.mktemp("report_run")
    cfg = load_config(
        run_overrides(
            out,
            f"actor_rollout_ref.model.path={warm_model_dir}",
            "trainer.total_steps=3",
            "trainer.test_freq=3",
        )
    )
    fit(cfg)
    return out


def test_run_writes_a_self_contained_report(short_run_dir):
    text = (short_run_dir / "report.html").read_text()
    assert_self_contained(text)
    page = Page(text)
    assert page.sections[:3] == ["overview", "doctor", "curves"] and "samples" in page.sections
    assert set(page.charts) == {c.title for c in CURVES} | {"time per stage"}
    images = decoded_images(page)
    assert len(images) == len(page.charts)
    for image in images:  # a chart has content, not one flat colour
        assert image.width > 200 and len(image.convert("L").getcolors(1 << 16)) > 10
    # 8 samples of the validation before training and 8 after the last step, plus the header
    assert page.table_rows["samples"] == 17
    samples = [json.loads(line) for line in (short_run_dir / "samples.jsonl").open()]
    assert {s["step"] for s in samples} == {0, 3}
    first = samples[0]
    assert first["prompt"].endswith("=") and first["score"] in (0.0, 1.0)
    assert f">{first['prompt']}<" in text and "No problem found" in text
    summary = json.loads((short_run_dir / "summary.json").read_text())
    assert summary["report"] == str(short_run_dir / "report.html")


def test_mmrl_report_rebuilds_it(short_run_dir, capsys):
    path = short_run_dir / "report.html"
    path.unlink()
    assert main(["report", str(short_run_dir)]) == 0
    assert str(path) in capsys.readouterr().out
    assert set(Page(path.read_text()).charts) >= {"reward (training)", "time per stage"}


def test_a_crashed_run_gets_a_report_that_says_why(tmp_path, warm_model_dir):
    """Every sample invalid and trainer.max_invalid_rate=0: the run stops at step 1."""
    verifier = tmp_path / "never.py"
    verifier.write_text(
        "import numpy as np\nfrom mmrl.verifiers import VerifierOutput\n"
        "def never(batch):\n"
        "    return VerifierOutput(np.zeros(len(batch)), np.zeros(len(batch), bool))\n"
    )
    cfg = load_config(
        run_overrides(
            tmp_path / "run",
            f"actor_rollout_ref.model.path={warm_model_dir}",
            "trainer.total_steps=3",
            "trainer.val_before_train=false",
            "trainer.max_invalid_rate=0.0",
            "trainer.invalid_rate_patience=1",
            f"reward.verifiers=[{{name: '{verifier}:never'}}]",
        )
    )
    with pytest.raises(VerifierError):
        fit(cfg)
    text = (tmp_path / "run" / "report.html").read_text()
    assert "The run stopped with: InvalidRateError" in text
    assert "did not finish" in text
    assert "invalid-sample rate" in Page(text).charts


def test_an_old_or_torn_run_folder_reports_what_it_has(tmp_path):
    """An older run: a few keys only, no samples, no config, a torn last line."""
    rows = [{"step": s, "critic/score/mean": 0.1 * s, "timing_s/gen": 0.5} for s in (1, 2, 3)]
    lines = [json.dumps(r) for r in rows] + ['{"step": 4, "critic/sc']
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines))
    text = write_report(tmp_path).read_text()
    page = Page(text)
    assert page.charts == ["reward (training)", "time per stage"]
    assert "Not logged by this run: validation, KL" in text and "samples" not in page.sections


def test_report_of_a_folder_that_is_no_run_is_one_line(tmp_path, capsys):
    assert main(["report", str(tmp_path / "missing")]) == 1
    assert main(["report", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("mmrl: error:") and "is not a folder" in err[0]
    assert "has no metrics.jsonl" in err[2] and err[3].strip().startswith("fix:")


def test_vlm_samples_keep_thumbnails_of_their_prompt_images(tmp_path):
    """Validation row i answers prompt i // n: its thumbnail is that prompt's image."""
    data = make_counting_dataset(VisualCountingConfig(), 3, seed=0)
    scores = torch.zeros(6, 4)
    scores[[0, 3], -1] = 1.0
    batch = Batch.from_dict(
        tensors={"token_level_scores": scores, "valid_mask": torch.ones(6, dtype=torch.bool)},
        non_tensor={
            "raw_prompt": [p for p in data.problems for _ in range(2)],
            "response_text": [f"<answer>{i}</answer>" for i in range(6)],
            "ground_truth": [g for g in data.ground_truth for _ in range(2)],
        },
    )
    SampleLog(tmp_path, val_images=data.images).record(0, batch, repeats=2)
    rows = read_samples(tmp_path)
    assert [r["score"] for r in rows] == [1.0, 0.0, 0.0, 1.0, 0.0, 0.0]
    thumb = Image.open(tmp_path / rows[3]["images"][0]).convert("RGB")
    source = Image.open(io.BytesIO(data.images[1][0])).convert("RGB").resize(thumb.size)
    other = Image.open(io.BytesIO(data.images[0][0])).convert("RGB").resize(thumb.size)
    diff = np.abs(np.asarray(thumb, float) - np.asarray(source, float)).mean()
    assert diff < np.abs(np.asarray(thumb, float) - np.asarray(other, float)).mean()
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "critic/score/mean": 0.5}\n')
    page = Page(write_report(tmp_path).read_text())
    assert page.table_rows["samples"] == 7 and len(page.images) == 1 + 6  # a chart, 6 thumbs


def test_world_model_samples_show_no_empty_text_columns_and_fold_long_states(tmp_path):
    """A world model's validation rows have no text prompt or response, and their ground truth
    is a whole environment state: no empty columns, and the state folded after its start."""
    state = json.dumps([{"walls": str(np.ones((8, 8), dtype=bool)), "agent": "[6 6]"}])
    with (tmp_path / "samples.jsonl").open("w") as f:
        for step in (0, 5):
            row = {"step": step, "index": 0, "prompt": None, "response": None}
            f.write(json.dumps({**row, "ground_truth": state, "score": -0.02, "valid": True}))
            f.write("\n")
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "critic/score/mean": 0.5}\n')
    text = write_report(tmp_path).read_text()
    header = text[text.index('<table class="samples">') :].split("</tr>")[0]
    assert "<th>prompt</th>" not in header and "<th>response</th>" not in header
    assert "<th>ground truth</th>" in header
    assert text.count("<details><summary>") == 2 and len(state) > 120
