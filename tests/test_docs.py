"""Docs that run: every code block with Python or an ``mmrl`` command is tagged, dry-run
commands compose and validate, run Python executes, and (slow tier) run commands train for real.

Tags are described in tests/doc_blocks.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections import defaultdict

import pytest

from tests.doc_blocks import ROOT, all_blocks, dry_run, run_argv

BLOCKS = all_blocks()
DRY = [(b, argv) for b in BLOCKS if b.tag == "dry-run" for argv in b.commands]
RUN_COMMANDS = [(b, argv) for b in BLOCKS if b.tag == "run" for argv in b.commands]
PY_FILES: dict[str, list] = defaultdict(list)
for _b in BLOCKS:
    if _b.tag == "run" and _b.is_python:
        PY_FILES[str(_b.path.relative_to(ROOT))].append(_b)


def test_every_block_with_code_or_a_command_is_tagged():
    untagged = [b.where for b in BLOCKS if b.needs_tag and b.tag is None]
    assert not untagged, (
        f"untagged code blocks {untagged}: put <!-- doc: run -->, <!-- doc: dry-run --> or "
        "<!-- doc: skip(reason) --> on the line above each (tests/doc_blocks.py)"
    )
    no_reason = [b.where for b in BLOCKS if b.tag == "skip" and not b.reason.strip()]
    assert not no_reason, f"skip needs a reason: skip(why) at {no_reason}"
    dry_python = [b.where for b in BLOCKS if b.tag == "dry-run" and b.is_python]
    assert not dry_python, f"dry-run is for mmrl commands, not Python: {dry_python}"
    empty = [b.where for b in BLOCKS if b.tag == "dry-run" and not b.commands]
    assert not empty, f"dry-run blocks without an mmrl command: {empty}"


def test_the_tag_parser_reads_every_form(tmp_path):
    from tests.doc_blocks import read_blocks

    doc = tmp_path / "x.md"
    doc.write_text(
        textwrap.dedent(
            """\
            <!-- doc: run trainer.total_steps=2 -->
            ```bash
            .venv/bin/mmrl train a=1 \\
              b=2   # comment
            ```
            <!-- doc: skip(needs a GPU) -->

            ```python
            print(1)
            ```
            ```
            mmrl eval --model x
            ```
            ```yaml
            key: value
            ```
            """
        )
    )
    run, skip, untagged, yaml = read_blocks(doc)
    assert (run.tag, run.extra, run.commands) == ("run", ["trainer.total_steps=2"],
                                                  [["train", "a=1", "b=2"]])  # fmt: skip
    assert (skip.tag, skip.reason, skip.is_python) == ("skip", "needs a GPU", True)
    assert untagged.tag is None and untagged.needs_tag
    assert not yaml.needs_tag


@pytest.mark.parametrize(("block", "argv"), DRY, ids=[f"{b.where}:{a[0]}" for b, a in DRY])
def test_dry_run_commands_compose_and_validate(block, argv):
    dry_run(argv)


DRIVER = """
import json, sys, traceback
blocks = json.loads(open(sys.argv[1]).read())
namespace = {"__name__": "__main__"}
for where, code in blocks:
    try:
        exec(compile(code, where, "exec"), namespace)
    except BaseException:
        traceback.print_exc()
        print(f"doc block {where} failed", file=sys.stderr)
        sys.exit(1)
"""


@pytest.mark.parametrize("doc", sorted(PY_FILES))
def test_python_run_blocks_execute(doc, tmp_path):
    """A file's run blocks, in order, in one fresh interpreter whose working folder is empty."""
    blocks = [(b.where, b.text) for b in PY_FILES[doc]]
    (tmp_path / "blocks.json").write_text(json.dumps(blocks))
    (tmp_path / "driver.py").write_text(DRIVER)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MPLBACKEND": "Agg"}
    work = tmp_path / "work"
    work.mkdir()
    proc = subprocess.run(
        [sys.executable, str(tmp_path / "driver.py"), str(tmp_path / "blocks.json")],
        cwd=work, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("block", "argv"), RUN_COMMANDS, ids=[f"{b.where}:{a[0]}" for b, a in RUN_COMMANDS]
)
def test_run_commands_train_with_a_tiny_budget(block, argv, tmp_path):
    full = run_argv(argv, block.extra, tmp_path / "out")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "mmrl.trainer.cli", *full],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, f"mmrl {' '.join(full)}\n{proc.stderr[-3000:]}"
