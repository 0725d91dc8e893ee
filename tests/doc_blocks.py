"""Code blocks of README.md and docs/*.md, and what each one's tag asks a test to do.

A block that holds Python or an ``mmrl ...`` command carries a tag, an HTML comment on the
nearest non-blank line above its fence:

- ``<!-- doc: run -->``: Python runs as is; the run blocks of one file share one namespace,
  in order, as a reader who pastes them one after another. A command runs for real (slow
  tier), with the tag's words after ``run`` appended as overrides to keep it cheap:
  ``<!-- doc: run trainer.total_steps=2 task.sft.steps=20 -->``.
- ``<!-- doc: dry-run -->``: each ``mmrl`` command's configuration is composed and validated,
  nothing runs.
- ``<!-- doc: skip(reason) -->``: neither, for the reason given (a placeholder path, a
  sketch that is not a whole program, minutes of training).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([\w+-]*)")
TAG = re.compile(r"^\s*<!--\s*doc:\s*(run|dry-run|skip)\s*(?:\((.*)\))?\s*(.*?)\s*-->\s*$")
MMRL = {"mmrl", ".venv/bin/mmrl"}


@dataclass
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    tag: str | None  # run | dry-run | skip | None
    reason: str  # skip's reason
    extra: list[str]  # run's appended overrides

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    @property
    def is_python(self) -> bool:
        return self.lang in ("python", "py", "python3")

    @property
    def commands(self) -> list[list[str]]:
        """The ``mmrl`` commands of a shell block, each as argv after ``mmrl``."""
        if self.is_python:
            return []
        out = []
        for line in self.text.replace("\\\n", " ").splitlines():
            try:
                words = shlex.split(line, comments=True)
            except ValueError:  # not shell (a YAML or text block with a stray quote)
                continue
            if words and words[0] in MMRL:
                out.append(words[1:])
        return out

    @property
    def needs_tag(self) -> bool:
        return self.is_python or bool(self.commands)


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def read_blocks(path: Path) -> list[Block]:
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, j = m.group(2), i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence[:3]):
            j += 1
        k = i - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        tag = TAG.match(lines[k]) if k >= 0 else None
        indent = len(m.group(1))
        body = "\n".join(line[indent:] for line in lines[i + 1 : j])
        blocks.append(
            Block(
                path=path,
                line=i + 1,
                lang=m.group(3).lower(),
                text=body,
                tag=tag.group(1) if tag else None,
                reason=(tag.group(2) or "") if tag else "",
                extra=shlex.split(tag.group(3)) if tag and tag.group(3) else [],
            )
        )
        i = j + 1
    return blocks


def all_blocks() -> list[Block]:
    return [b for path in doc_files() for b in read_blocks(path)]


def split_config_name(argv: list[str]) -> tuple[str, list[str]]:
    """``(config_name, overrides)`` of ``mmrl train`` arguments."""
    name, rest, it = "train", [], iter(argv)
    for word in it:
        if word == "--config-name":
            name = next(it)
        elif word.startswith("--config-name="):
            name = word.split("=", 1)[1]
        else:
            rest.append(word)
    return name, rest


def dry_run(argv: list[str]) -> None:
    """Compose and validate the configuration of one ``mmrl`` command; run nothing."""
    command, args = argv[0], argv[1:]
    if command == "train":
        from mmrl.config import load_config
        from mmrl.tasks import get_task

        name, overrides = split_config_name(args)
        cfg = load_config(overrides, name)
        get_task(cfg.task.get("name", ""))(cfg.task)  # the task parses and checks its own keys
    elif command == "pretrain-worldmodel":
        from mmrl.worldmodel.pretrain import load_pretrain_config

        load_pretrain_config(args)
    else:
        raise ValueError(
            f"dry-run checks 'mmrl train' and 'mmrl pretrain-worldmodel', not 'mmrl {command}'; "
            "tag the block run or skip(reason)"
        )


def run_argv(argv: list[str], extra: list[str], output_dir: Path) -> list[str]:
    """The full ``mmrl`` argv a slow test runs: the doc's, the tag's budget, a private output."""
    command = argv[0]
    if command == "train":
        return [*argv, *extra, f"trainer.output_dir={output_dir}", "trainer.progress_bar=false"]
    if command == "pretrain-worldmodel":
        return [*argv, *extra, f"output_dir={output_dir}"]
    return [*argv, *extra]
