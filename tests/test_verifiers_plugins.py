"""Plugin discovery: registered names, module:function, file.py:function and real entry points."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from mmrl.errors import VerifierError
from mmrl.protocol import Batch
from mmrl.verifiers import available, get_verifier, score_batch
from mmrl.verifiers.plugins import portable_ref
from mmrl.verifiers.spec import bind, bind_all

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "custom_verifier"


def text_batch(texts: list[str]) -> Batch:
    return Batch.from_dict(non_tensor={"response_text": texts, "ground_truth": texts})


def write_plugin(folder: Path, name: str, body: str) -> Path:
    path = folder / name
    path.write_text(textwrap.dedent(body))
    return path


def test_registered_name_and_module_function():
    assert get_verifier("exact_answer") is get_verifier("mmrl.verifiers.text:exact_answer")
    bound = bind({"name": "mmrl.verifiers.image:mae", "weight": -1.0})
    assert bound.name == "mae" and bound.weight == -1.0


def test_path_plugin_is_loaded_once_and_named_after_its_function(tmp_path):
    path = write_plugin(
        tmp_path,
        "my_rewards.py",
        """
        LOADS = []
        LOADS.append(1)

        def length_bonus(batch, per_char=0.1):
            return [per_char * len(t) for t in batch["response_text"]]
        """,
    )
    ref = f"{path}:length_bonus"
    fn = get_verifier(ref)
    assert fn is get_verifier(ref)  # cached: the file is imported once
    assert sys.modules[fn.__module__].LOADS == [1]
    out = score_batch(
        text_batch(["ab", "abcd"]), [{"name": ref, "weight": 2.0, "kwargs": {"per_char": 0.5}}]
    )
    np.testing.assert_allclose(out.scores, [2.0, 4.0])
    assert out.metrics["reward/length_bonus/mean"] == 1.5
    assert portable_ref(ref, fn) == f"{path.resolve()}:length_bonus"


def test_bad_references_explain_what_was_expected(tmp_path):
    # A reference that names nothing is the user's mistake: a VerifierError, printed short.
    with pytest.raises(VerifierError, match="unknown verifier 'nope'.*not registered.*entry point"):
        get_verifier("nope")
    with pytest.raises(VerifierError, match="does not exist"):
        get_verifier(f"{tmp_path}/missing.py:fn")
    with pytest.raises(VerifierError, match="cannot import module 'no_such_pkg.mod'"):
        get_verifier("no_such_pkg.mod:fn")
    with pytest.raises(VerifierError, match="has no attribute 'nothing'"):
        get_verifier("mmrl.verifiers.image:nothing")
    with pytest.raises(ValueError, match="appear more than once.*alias"):
        bind_all([("psnr", 1.0), ("psnr", 0.5)])
    assert [
        b.name
        for b in bind_all(
            [("psnr", 1.0), {"name": "psnr", "alias": "psnr_last", "kwargs": {"aggregate": "last"}}]
        )
    ] == ["psnr", "psnr_last"]


def test_process_mode_needs_an_importable_function():
    from mmrl.verifiers import register_verifier

    def local(batch):
        return [0.0] * len(batch)

    register_verifier("test_plugins_local")(local)
    with pytest.raises(ValueError, match="cannot run in a worker process"):
        bind({"name": "test_plugins_local", "mode": "process"})


def fake_distribution(site: Path, module_body: str) -> None:
    """An installed distribution as importlib.metadata sees it: a module plus a dist-info folder."""
    (site / "fake_mmrl_plugin.py").write_text(textwrap.dedent(module_body))
    info = site / "fake_mmrl_plugin-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-mmrl-plugin\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        "[mmrl.verifiers]\nshout_ratio = fake_mmrl_plugin:shout_ratio\n"
    )


def test_entry_point_from_a_dist_info_on_sys_path(tmp_path, monkeypatch):
    fake_distribution(
        tmp_path,
        """
        def shout_ratio(batch):
            return [sum(c.isupper() for c in t) / max(len(t), 1) for t in batch["response_text"]]
        """,
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "shout_ratio" in available()
    out = score_batch(text_batch(["AB", "aB"]), [("shout_ratio", 1.0)])
    np.testing.assert_allclose(out.scores, [1.0, 0.5])
    assert (
        portable_ref("shout_ratio", get_verifier("shout_ratio")) == "fake_mmrl_plugin:shout_ratio"
    )


@pytest.mark.slow  # pip install plus starting worker processes: ~10 s
def test_example_package_installed_with_pip_is_discovered(tmp_path, monkeypatch):
    """The docs' plugin package, installed for real (into a temporary target), then used by name."""
    target, source = tmp_path / "site", tmp_path / "src"
    shutil.copytree(EXAMPLE, source)  # building writes into the source folder; keep the repo clean
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--disable-pip-version-check", "--target", str(target), str(source)],
        check=True, capture_output=True,
    )  # fmt: skip
    monkeypatch.syspath_prepend(str(target))
    names = available()
    assert names["brightness_match"] == "entry point mmrl_example_verifier:brightness_match"
    frames = torch.full((2, 2, 8, 8, 3), 0.5)
    gt = torch.stack([torch.full((2, 8, 8, 3), 0.5), torch.full((2, 8, 8, 3), 0.25)])
    batch = Batch.from_dict(
        {"pred_frames": frames, "gt_frames": gt}, {"response_text": ["because because", "no"]}
    )
    specs = [("brightness_match", 1.0), {"name": "keyword_count", "weight": 1.0, "timeout_s": 60}]
    out = score_batch(
        batch, specs
    )  # keyword_count runs in a worker process that imports the package
    np.testing.assert_allclose(out.scores, [1.0 + 2 / 3, 0.75])
    assert out.metrics["reward/brightness_match/pred_brightness"] == pytest.approx(0.5)
    assert bind(specs[1]).options.mode == "process"
