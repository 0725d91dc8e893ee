"""VLM prompt datasets, and the geometry3k-style parquet layout that users' data comes in.

Schema, one row per problem (the column names can be remapped):

==========  ===========================================  =======================================
column      arrow type                                   meaning
==========  ===========================================  =======================================
problem     string                                       question text; each ``<image>`` (and
                                                         ``<video>``) marks where the next image
                                                         (video) goes
answer      string (integers and floats are accepted)    the ground truth the verifiers check
images      list<struct<bytes: binary, path: string>>    one entry per ``<image>``, in order;
                                                         ``bytes`` (encoded PNG/JPEG) wins over
                                                         ``path`` when both are set
videos      list<string> or list<struct<bytes, path>>    optional; one mp4 per ``<video>``
==========  ===========================================  =======================================

Any other column is carried per row in ``extra_info``. Media paths are relative to the
parquet file's folder and must stay inside it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from mmrl.errors import DataError
from mmrl.processors.vision import PLACEHOLDER, VisionSample, chat_prompt

MEDIA_STRUCT = pa.struct([("bytes", pa.binary()), ("path", pa.string())])


class ParquetSchemaError(DataError):
    """A parquet file does not follow the VLM prompt layout."""


class UnsafeMediaPathError(ParquetSchemaError):
    """A row's media path points outside the parquet file's folder."""


@dataclass
class VisionPromptDataset:
    """Problems (text with ``<image>``/``<video>`` placeholders), answers and media, per row.

    ``images[i]``/``videos[i]`` hold row i's media in placeholder order: PIL images, encoded
    bytes or paths (see :class:`mmrl.processors.VisionSample`).
    """

    problems: list[str]
    ground_truth: list[Any]
    images: list[list[Any]] = field(default_factory=list)
    videos: list[list[Any]] = field(default_factory=list)
    extra_info: list[dict] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = len(self.problems)
        for name in ("images", "videos", "extra_info"):
            if not getattr(self, name):
                setattr(self, name, [[] if name != "extra_info" else {} for _ in range(n)])
        for name in ("ground_truth", "images", "videos", "extra_info"):
            if len(getattr(self, name)) != n:
                raise DataError(f"dataset has {n} problems but {len(getattr(self, name))} {name}")

    def __len__(self) -> int:
        return len(self.problems)

    def samples(
        self,
        processor: Any,
        system: str | None = None,
        suffix: str = "",
        key_prefix: str | None = None,
    ) -> list[VisionSample]:
        """Chat-template samples: ``problem + suffix`` as the user turn, media attached.

        ``key_prefix`` (e.g. ``"train"``) gives each sample the cache key ``"<prefix>/<row>"``;
        without it the processor hashes the content.
        """
        return [
            VisionSample(
                prompt=chat_prompt(processor, problem + suffix, system),
                images=list(self.images[i]),
                videos=list(self.videos[i]),
                key=None if key_prefix is None else f"{key_prefix}/{i}",
            )
            for i, problem in enumerate(self.problems)
        ]


def write_vision_parquet(
    path: str | Path,
    problems: Sequence[str],
    answers: Sequence[str],
    images: Sequence[Sequence[bytes]],
    videos: Sequence[Sequence[str]] | None = None,
) -> Path:
    """Write rows in the layout above (images as ``{bytes, path: null}``); returns ``path``."""
    columns = {
        "problem": pa.array(list(problems), pa.string()),
        "answer": pa.array([str(a) for a in answers], pa.string()),
        "images": pa.array(
            [[{"bytes": b, "path": None} for b in row] for row in images], pa.list_(MEDIA_STRUCT)
        ),
    }
    if videos is not None:
        columns["videos"] = pa.array([list(row) for row in videos], pa.list_(pa.string()))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns), path)
    return path


def load_vision_parquet(
    path: str | Path,
    problem_key: str = "problem",
    answer_key: str = "answer",
    images_key: str = "images",
    videos_key: str = "videos",
    max_rows: int | None = None,
) -> VisionPromptDataset:
    """Read a parquet file in the layout above, checking its schema and each row's media count.

    Raises :class:`ParquetSchemaError` naming the file, the column (and row), what was
    expected and what was found.
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(
            f"parquet file {path} does not exist", fix="check task.train_files/val_files"
        )
    try:  # a damaged file must name itself, not surface as an arrow error from deep inside
        schema = pq.read_schema(path)
    except (pa.ArrowException, OSError, ValueError) as err:  # ValueError: bad UTF-8 in the footer
        raise ParquetSchemaError(f"{path}: not a readable parquet file ({err})") from err
    _check_column(path, schema, problem_key, "string", _is_string)
    _check_column(
        path,
        schema,
        answer_key,
        "string (or a number)",
        lambda t: _is_string(t) or pa.types.is_integer(t) or pa.types.is_floating(t),
    )
    has_images = images_key in schema.names
    if has_images:
        _check_column(
            path, schema, images_key, "list<struct<bytes: binary, path: string>>", _is_media_list
        )
    has_videos = videos_key in schema.names
    if has_videos:
        _check_column(
            path,
            schema,
            videos_key,
            "list<string> or list<struct<bytes: binary, path: string>>",
            lambda t: _is_media_list(t) or (_is_list(t) and _is_string(t.value_type)),
        )
    try:  # reading and converting the values both decode pages: either can meet the damage
        table = pq.read_table(path)
        if max_rows is not None:
            table = table.slice(0, max_rows)
        problems = table.column(problem_key).to_pylist()
        answers = table.column(answer_key).to_pylist()
        n = len(problems)
        images = table.column(images_key).to_pylist() if has_images else [[] for _ in range(n)]
        videos = table.column(videos_key).to_pylist() if has_videos else [[] for _ in range(n)]
        names = (problem_key, answer_key, images_key, videos_key)
        others = [c for c in table.column_names if c not in names]
        extra = table.select(others).to_pylist() if others else [{} for _ in range(n)]
    except (pa.ArrowException, OSError, ValueError) as err:  # ValueError: e.g. bad UTF-8
        raise ParquetSchemaError(
            f"{path}: damaged parquet file, its data cannot be read ({err})"
        ) from err
    for row in range(n):
        for column, value in ((problem_key, problems[row]), (answer_key, answers[row])):
            if value is None:
                raise ParquetSchemaError(f"{path}: column {column!r}, row {row} is null")
        images[row], videos[row] = images[row] or [], videos[row] or []
        counts = {"image": 0, "video": 0}
        for kind in PLACEHOLDER.findall(problems[row]):
            counts[kind] += 1
        for kind, column, items in (
            ("image", images_key, images[row]),
            ("video", videos_key, videos[row]),
        ):
            if counts[kind] != len(items):
                raise ParquetSchemaError(
                    f"{path}: row {row} has {counts[kind]} <{kind}> placeholders in column "
                    f"{problem_key!r} "
                    f"but {len(items)} entries in column {column!r}; expected one per placeholder"
                )
            for j, item in enumerate(items):
                items[j] = _resolve_media(
                    item, path.parent, f"{path}: column {column!r}, row {row}, entry {j}"
                )
    return VisionPromptDataset(problems, [str(a) for a in answers], images, videos, extra)


def _resolve_media(item: Any, root: Path, where: str) -> Any:
    """Bytes if present, else the path, resolved against the parquet's folder.

    A parquet file may come from anywhere, so a path must stay inside its folder: an
    absolute path or one that climbs out (``../``) could make training read any file the
    user can read.
    """
    if isinstance(item, dict):
        if item.get("bytes") is not None:
            return item["bytes"]
        item = item.get("path")
        if item is None:
            raise ParquetSchemaError(f"{where} has neither bytes nor path")
    # Lexical, not Path.resolve(): a symlinked folder inside the dataset stays allowed.
    base = os.path.normpath(os.path.abspath(root))
    full = os.path.normpath(os.path.join(base, str(item)))
    if Path(str(item)).is_absolute() or os.path.commonpath([base, full]) != base:
        raise UnsafeMediaPathError(
            f"{where}: media path {str(item)!r} is outside the parquet file's folder {base}; "
            "store paths relative to that folder (no '..', no absolute paths), or embed the "
            "bytes"
        )
    return full


def _check_column(path: Path, schema: pa.Schema, name: str, expected: str, ok) -> None:
    if name not in schema.names:
        raise ParquetSchemaError(
            f"{path}: missing column {name!r} (expected {expected}); found columns {schema.names}. "
            "Rename the column or pass its name (problem_key/answer_key/images_key)"
        )
    found = schema.field(name).type
    if not ok(found):
        raise ParquetSchemaError(f"{path}: column {name!r} has type {found}, expected {expected}")


def _is_string(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t)


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t)


def _is_media_list(t: pa.DataType) -> bool:
    if not _is_list(t) or not pa.types.is_struct(t.value_type):
        return False
    fields = {
        t.value_type.field(i).name: t.value_type.field(i).type
        for i in range(t.value_type.num_fields)
    }
    bytes_ok = (
        "bytes" not in fields
        or pa.types.is_binary(fields["bytes"])
        or pa.types.is_large_binary(fields["bytes"])
    )
    path_ok = "path" not in fields or _is_string(fields["path"])
    return bool({"bytes", "path"} & fields.keys()) and bytes_ok and path_ok
