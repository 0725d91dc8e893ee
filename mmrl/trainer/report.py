"""The run report: one self-contained HTML file (``<run>/report.html``), images inlined as
base64, readable offline, no script.

It shows the doctor's findings, the curves (reward, validation, KL, entropy, clip fraction,
grad norm, response length, invalid-sample rate), a stacked bar of time per stage, the
validation samples that ``samples.jsonl`` logged (prompts, responses, rewards, image
thumbnails) and, for world models, the held-out evaluation: frame strips, the GIF and the
metrics per future step. Everything is read from the run folder, so ``mmrl report RUN_DIR``
rebuilds it for any run, also one that crashed or is still running; what a run did not log is
left out.
"""

from __future__ import annotations

import base64
import html
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from mmrl.config.doctor import DoctorConfig
from mmrl.config.validate import value_problems
from mmrl.errors import ConfigError, DataError
from mmrl.trainer.doctor import Finding, diagnose
from mmrl.trainer.report_plots import CURVES, curve_png, stage_times_png
from mmrl.trainer.samples import read_jsonl, read_samples

REPORT_FILE = "report.html"
METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.yaml"
WORLDMODEL_EVAL_FILE = "worldmodel_eval.json"
WORLDMODEL_MEDIA = (  # what the world-model task draws under <run>/report/
    ("frames.png", "image/png", "per held-out window: context | truth | base | RL (greedy)"),
    ("rollout.gif", "image/gif", "the same windows animated: truth | base | RL"),
)
STEP_METRICS = ("psnr", "lpips", "mae")

STYLE = """
body{font-family:system-ui,sans-serif;margin:24px;color:#222;max-width:1400px}
h1{font-size:22px}h2{font-size:18px;border-bottom:1px solid #ccc;padding-bottom:4px}
.charts{display:flex;flex-wrap:wrap;gap:12px}
figure.chart{margin:0;border:1px solid #ddd;padding:6px;background:#fff}
figure.chart figcaption{font-size:12px;color:#555;max-width:420px}
table{border-collapse:collapse;font-size:13px;margin:6px 0}
td,th{border:1px solid #ccc;padding:3px 6px;vertical-align:top;text-align:left}
td.text{font-family:monospace;white-space:pre-wrap;max-width:420px}
.finding{background:#fff4e0;border-left:4px solid #e89a1c;padding:6px 10px;margin:6px 0}
.ok{background:#e8f6e8;border-left:4px solid #3a3;padding:6px 10px}
.invalid{color:#b00}
"""


@dataclass
class RunRecord:
    """What a run folder holds: the logged ``history`` (one dict per step), ``summary.json``
    (empty for a run that did not finish), the logged ``samples``, the world-model evaluation
    table (or None) and the run's config (or None)."""

    run_dir: Path
    history: list[dict] = field(default_factory=list)
    summary: dict = field(default_factory=dict)
    samples: list[dict] = field(default_factory=list)
    worldmodel_eval: dict | None = None
    config: Any = None


def load_run(run_dir: str | Path, history: list[dict] | None = None) -> RunRecord:
    """Read a run folder; ``history`` (the trainer's own, when it writes no metrics.jsonl)
    replaces ``metrics.jsonl``."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise DataError(
            f"{run_dir} is not a folder", fix="pass a run's trainer.output_dir to mmrl report"
        )
    if history is None:
        history = read_jsonl(run_dir / METRICS_FILE)
        if not history and not (run_dir / METRICS_FILE).is_file():
            raise DataError(
                f"{run_dir} has no {METRICS_FILE}: it is not a run folder, or the run logged "
                "without the jsonl logger",
                fix="pass the trainer.output_dir of a run whose trainer.loggers include jsonl",
            )
    record = RunRecord(run_dir, history, samples=read_samples(run_dir))
    record.summary = _json_or(run_dir / "summary.json", {})
    record.worldmodel_eval = _json_or(run_dir / WORLDMODEL_EVAL_FILE, None)
    if (run_dir / CONFIG_FILE).is_file():
        record.config = OmegaConf.load(run_dir / CONFIG_FILE)
    return record


def doctor_config(record: RunRecord, overrides: list[str] = ()) -> DoctorConfig:
    """The run's ``trainer.doctor`` thresholds (defaults when its config is not there), with
    ``overrides`` (``trainer.doctor.key=value``) on top."""
    merged = OmegaConf.structured(DoctorConfig)
    try:
        if record.config is not None:  # keys of another mmrl version are left out
            saved = OmegaConf.to_container(record.config.get("trainer", {}).get("doctor", {}))
            known = {k: v for k, v in saved.items() if k in merged}
            merged = OmegaConf.merge(merged, known)
        dotlist = [o.removeprefix("trainer.doctor.") for o in overrides]
        cfg = OmegaConf.to_object(OmegaConf.merge(merged, OmegaConf.from_dotlist(dotlist)))
    except OmegaConfBaseException as err:
        raise ConfigError(f"trainer.doctor: {str(err).splitlines()[0]}") from None
    problems = value_problems(cfg)
    if problems:
        raise ConfigError([f"trainer.doctor.{p}" for p in problems])
    return cfg


def _json_or(path: Path, default: Any) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return default


def _img(data: bytes, mime: str = "image/png", alt: str = "", cls: str = "") -> str:
    src = base64.b64encode(data).decode("ascii")
    return f'<img class="{cls}" alt="{html.escape(alt)}" src="data:{mime};base64,{src}">'


def _num(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if math.isfinite(value) else "–"
    return html.escape(str(value)) if value is not None else "–"


def overview(record: RunRecord, error: str | None) -> str:
    steps = [row["step"] for row in record.history if isinstance(row.get("step"), int)]
    vals = [row["val/score/mean"] for row in record.history if "val/score/mean" in row]
    status = "finished" if record.summary else "did not finish (no summary.json)"
    rows = [
        ("run folder", html.escape(str(record.run_dir))),
        ("status", status),
        ("steps logged", f"{len(steps)} (last: {max(steps) if steps else '–'})"),
        ("validation score", " → ".join(_num(v) for v in (vals[:1] + vals[-1:])) or "–"),
        ("wall time (s)", _num(record.summary.get("wall_time_s"))),
        ("peak memory (GiB)", _num(record.summary.get("peak_memory_gib"))),
    ]
    out = ['<section id="overview"><h2>Overview</h2><table class="overview">']
    out += [f"<tr><th>{k}</th><td>{v}</td></tr>" for k, v in rows]
    out.append("</table>")
    if error:
        out.append(f'<p class="finding">The run stopped with: {html.escape(error)}</p>')
    return "\n".join(out + ["</section>"])


def doctor_section(findings: list[Finding]) -> str:
    out = ['<section id="doctor"><h2>Doctor</h2>']
    if not findings:
        out.append('<p class="ok">No problem found (mmrl doctor checks, in data-flow order).</p>')
    for f in findings:
        out.append(f'<div class="finding" data-check="{html.escape(f.check)}">')
        out.append(f"{html.escape(f.line())}</div>")
    return "\n".join(out + ["</section>"])


def curves_section(history: list[dict]) -> str:
    out = ['<section id="curves"><h2>Curves</h2><div class="charts">']
    missing = []
    for curve in CURVES:
        png = curve_png(curve, history)
        if png is None:
            missing.append(curve.title)
            continue
        out.append(f'<figure class="chart" data-chart="{html.escape(curve.title)}">')
        out.append(_img(png, alt=curve.title))
        out.append(f"<figcaption>{html.escape(curve.note)}</figcaption></figure>")
    out.append("</div>")
    if missing:
        out.append(f"<p>Not logged by this run: {html.escape(', '.join(missing))}.</p>")
    out.append('<h2 id="timing">Time per stage</h2>')
    png = stage_times_png(history)
    if png is None:
        out.append("<p>No stage timings logged.</p>")
    else:
        out.append('<figure class="chart" data-chart="time per stage">')
        out.append(_img(png, alt="time per stage"))
        out.append(
            "<figcaption>seconds per RL step, one colour per timing_s/&lt;stage&gt; (validation "
            "is testing, checkpoints save_checkpoint)</figcaption></figure>"
        )
    return "\n".join(out + ["</section>"])


def samples_section(record: RunRecord) -> str:
    if not record.samples:
        return ""
    steps = sorted({s.get("step", 0) for s in record.samples})
    shown = [s for s in record.samples if s.get("step") in {steps[0], steps[-1]}]
    # A world model's samples have no text prompt or response: no empty columns for them.
    texts = [key for key in ("prompt", "response") if any(s.get(key) for s in shown)]
    out = [
        '<section id="samples"><h2>Validation samples</h2>',
        f"<p>The first and the last validation (steps {steps[0]} and {steps[-1]}).</p>",
        '<table class="samples"><tr><th>step</th><th>input</th>'
        + "".join(f"<th>{key}</th>" for key in texts)
        + "<th>ground truth</th><th>reward</th></tr>",
    ]
    for s in shown:
        images = "".join(
            _img(p.read_bytes(), alt="sample image", cls="thumb")
            for p in (record.run_dir / rel for rel in s.get("images", []))
            if p.is_file()
        )
        flag = "" if s.get("valid", True) else ' <span class="invalid">invalid</span>'
        cells = [
            _num(s.get("step")),
            images,
            *(f'<td class="text">{html.escape(s.get(key) or "")}</td>' for key in texts),
            f'<td class="text">{_folded(s.get("ground_truth") or "")}</td>',
            _num(s.get("score")) + flag,
        ]
        out.append(
            "<tr>" + "".join(c if c.startswith("<td") else f"<td>{c}</td>" for c in cells) + "</tr>"
        )
    return "\n".join(out + ["</table></section>"])


def _folded(text: str, shown: int = 120) -> str:
    """``text`` escaped, its first ``shown`` characters visible and the rest a click away (a
    world model's ground truth is a whole environment state)."""
    if len(text) <= shown:
        return html.escape(text)
    return (
        f"<details><summary>{html.escape(text[:shown])}...</summary>{html.escape(text)}</details>"
    )


def worldmodel_section(record: RunRecord) -> str:
    table = record.worldmodel_eval
    media = [
        (record.run_dir / "report" / name, mime, note) for name, mime, note in WORLDMODEL_MEDIA
    ]
    if not table and not any(p.is_file() for p, _, _ in media):
        return ""
    out = ['<section id="worldmodel"><h2>World model: held-out evaluation</h2>']
    rows = {f"{m} ({d})": v for m, by in (table or {}).items() for d, v in by.items()}
    if rows:
        future = max(
            (int(k.split("@t")[1]) for r in rows.values() for k in r if "@t" in k), default=1
        )
        cols = [f"{m}@t{t}" for m in STEP_METRICS for t in range(1, future + 1)]
        cols += ["repetition", "valid"]
        out.append('<table class="per-step"><tr><th>model (decoding)</th>')
        out.append("".join(f"<th>{html.escape(c)}</th>" for c in cols) + "</tr>")
        for name, m in rows.items():
            cells = "".join(f"<td>{_num(m.get(c))}</td>" for c in cols)
            out.append(f"<tr><th>{html.escape(name)}</th>{cells}</tr>")
        out.append(
            "</table><p>base = the pretrained start, rl = after RL; @tN = the Nth "
            "predicted frame; repetition: mmrl.verifiers.repetition.</p>"
        )
    for path, mime, note in media:
        if path.is_file():
            out.append(f'<figure class="chart" data-chart="{path.name}">')
            out.append(_img(path.read_bytes(), mime, alt=path.name))
            out.append(f"<figcaption>{note}</figcaption></figure>")
    return "\n".join(out + ["</section>"])


def render_html(record: RunRecord, findings: list[Finding], error: str | None = None) -> str:
    title = f"mmrl run report: {record.run_dir.name}"
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{html.escape(title)}</title><style>{STYLE}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
        overview(record, error),
        doctor_section(findings),
        curves_section(record.history),
        samples_section(record),
        worldmodel_section(record),
        "</body></html>",
    ]
    return "\n".join(p for p in parts if p) + "\n"


def write_report(
    run_dir: str | Path,
    history: list[dict] | None = None,
    error: str | None = None,
    doctor: DoctorConfig | None = None,
) -> Path:
    """Write ``<run_dir>/report.html`` from the run folder and return its path.

    ``history``: the trainer's in-memory history (else metrics.jsonl); ``error``: why the
    run stopped, when it crashed; ``doctor``: thresholds (else the run's config's).
    """
    record = load_run(run_dir, history)
    findings = diagnose(record.history, doctor or doctor_config(record), record.worldmodel_eval)
    path = record.run_dir / REPORT_FILE
    tmp = path.with_suffix(".html.tmp")
    tmp.write_text(render_html(record, findings, error))
    tmp.replace(path)  # a reader never sees half a report
    return path
