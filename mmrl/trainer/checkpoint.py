"""Checkpoint folders: written atomically, found again, pruned.

A run's checkpoints live in ``<output_dir>/global_step_N/``:

- ``actor/``: a ``save_pretrained`` folder that its policy family (and transformers'
  ``from_pretrained``) loads as is, with the task's extra files (tokenizer, processor,
  VQ tokenizer);
- ``actor_optim/``: the gathered AdamW state (safetensors) and the lr schedule (JSON);
- ``critic/`` (GAE runs): the critic's gathered weights and optimizer state;
- ``trainer_state.json``: the step, the prompt loader's order, position and RNG, the KL
  controller, the invalid-rate streak, the verifiers' error examples and every RNG
  (trainer process and each worker rank);
- ``config.json``: the run's config, which a resumed run is checked against.

A save writes everything into ``.tmp_global_step_N``, fsyncs it, renames it into place and
only then rewrites ``latest_checkpointed_iteration.txt`` (verl's file): a run killed at any
point leaves a "latest" that loads. ``MMRL_TEST_KILL_AT`` makes the worst points reachable
in tests (:func:`kill_point`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
from collections.abc import Callable
from pathlib import Path

from mmrl.errors import CheckpointError

LATEST_FILE = "latest_checkpointed_iteration.txt"
STATE_FILE = "trainer_state.json"
CONFIG_FILE = "config.json"
STEP_DIR = re.compile(r"^global_step_(\d+)$")
KILL_ENV = "MMRL_TEST_KILL_AT"


def step_dir(output_dir: Path, step: int) -> Path:
    return output_dir / f"global_step_{step}"


def kill_point(name: str, step: int) -> None:
    """SIGKILL this process when ``MMRL_TEST_KILL_AT`` names this point.

    ``save:after_write`` (any step) or ``save:after_write:4`` kills a save after its files
    are written and before the rename; ``after_step:3`` kills after step 3 is logged. A test
    hook: it lets a test kill a run exactly where a real crash would hurt most.
    """
    wanted = os.environ.get(KILL_ENV, "")
    if wanted in (name, f"{name}:{step}"):
        os.kill(os.getpid(), signal.SIGKILL)


def save_atomically(output_dir: Path, step: int, write: Callable[[Path], None]) -> Path:
    """Run ``write(folder)`` into a temporary folder, then publish it as ``global_step_<step>``
    and point ``latest_checkpointed_iteration.txt`` at it."""
    final = step_dir(output_dir, step)
    tmp = output_dir / f".tmp_global_step_{step}"
    for stale in output_dir.glob(".tmp_global_step_*"):  # saves that were killed half-way
        shutil.rmtree(stale, ignore_errors=True)
    tmp.mkdir(parents=True)
    write(tmp)
    _fsync_tree(tmp)
    kill_point("save:after_write", step)
    if final.exists():  # a run started over (resume_mode=disable) in the same folder
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(output_dir)
    kill_point("save:after_rename", step)
    _write_atomically(output_dir / LATEST_FILE, f"{step}\n")
    return final


def latest_checkpoint(output_dir: Path) -> Path | None:
    """The folder ``latest_checkpointed_iteration.txt`` names, or None when there is none yet."""
    marker = output_dir / LATEST_FILE
    if not marker.is_file():
        return None
    text = marker.read_text().strip()
    if not text.isdigit():
        raise CheckpointError(
            f"{LATEST_FILE} holds {text!r}, not a step number",
            where=str(output_dir),
            fix="write the step of a complete global_step_N folder into it, or delete it",
        )
    folder = step_dir(output_dir, int(text))
    check_complete(folder)
    return folder


def check_complete(folder: Path) -> None:
    """Raise a :class:`CheckpointError` unless ``folder`` is a checkpoint that loads."""
    for part in (STATE_FILE, CONFIG_FILE, "actor", "actor_optim"):
        if not (folder / part).exists():
            raise CheckpointError(
                f"{folder.name} is not a complete checkpoint: {part} is missing",
                where=str(folder.parent),
                fix="resume from another global_step_N folder (trainer.resume_from_path)",
            )


def checkpoint_step(folder: Path) -> int:
    """N of a ``global_step_N`` folder."""
    match = STEP_DIR.match(folder.name)
    if match is None:
        raise CheckpointError(
            f"{folder} is not a global_step_N folder",
            fix="point trainer.resume_from_path at a run's global_step_N folder",
        )
    return int(match.group(1))


def prune(output_dir: Path, keep: int | None) -> list[Path]:
    """Delete all but the newest ``keep`` checkpoints (None keeps all); returns what went."""
    if keep is None:
        return []
    folders = sorted(
        (p for p in output_dir.iterdir() if STEP_DIR.match(p.name) and p.is_dir()),
        key=checkpoint_step,
    )
    gone = folders[:-keep]
    for folder in gone:
        shutil.rmtree(folder)
    return gone


def read_json(path: Path) -> dict:
    if not path.is_file():
        raise CheckpointError(f"{path.name} is missing", where=str(path.parent))
    return json.loads(path.read_text())


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_tree(root: Path) -> None:
    for folder, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(folder))


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
