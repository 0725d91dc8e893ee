"""VLM data: the geometry3k-style parquet loader and the procedural visual counting and comparison
tasks.
"""

from __future__ import annotations

import io
from collections import deque

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from mmrl.config import DataConfig
from mmrl.data import ParquetSchemaError, load_vision_parquet, write_vision_parquet
from mmrl.data.parquet import MEDIA_STRUCT
from mmrl.processors import VisionProcessor
from mmrl.processors.media import load_image
from mmrl.tasks import get_task
from mmrl.tasks.visual_comparison import VisualComparisonConfig, make_comparison_dataset
from mmrl.tasks.visual_counting import (
    COLORS,
    VisualCountingConfig,
    make_counting_dataset,
    render_shapes,
)


def png(color=(255, 0, 0), size=(28, 28)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


def test_parquet_round_trip(tmp_path):
    path = write_vision_parquet(
        tmp_path / "train.parquet",
        problems=["<image>What is x?", "Compare <image> and <image>.", "No image here."],
        answers=["3", "left", "7"],
        images=[[png()], [png((0, 255, 0)), png((0, 0, 255))], []],
    )
    ds = load_vision_parquet(path)
    assert len(ds) == 3 and ds.ground_truth == ["3", "left", "7"]
    assert [len(x) for x in ds.images] == [1, 2, 0]
    assert load_image(ds.images[1][1]).getpixel((0, 0)) == (0, 0, 255)


def test_parquet_with_paths_numbers_and_extra_columns(tmp_path):
    Image.new("RGB", (28, 28), (9, 9, 9)).save(tmp_path / "a.png")
    table = pa.table(
        {
            "problem": ["<image>Area?"],
            "answer": pa.array([12], pa.int64()),
            "images": pa.array([[{"bytes": None, "path": "a.png"}]], pa.list_(MEDIA_STRUCT)),
            "source": ["geo"],
        }
    )
    pq.write_table(table, tmp_path / "d.parquet")
    ds = load_vision_parquet(tmp_path / "d.parquet")
    assert ds.ground_truth == ["12"] and ds.extra_info == [{"source": "geo"}]
    assert ds.images[0][0] == str(tmp_path / "a.png")  # relative to the parquet file
    assert load_image(ds.images[0][0]).getpixel((0, 0)) == (9, 9, 9)


@pytest.mark.parametrize(
    ("columns", "message"),
    [
        (
            {"question": ["x"], "answer": ["1"]},
            r"missing column 'problem' \(expected string\); found columns \['question', 'answer'\]",
        ),
        ({"problem": [1], "answer": ["1"]}, r"column 'problem' has type int64, expected string"),
        (
            {"problem": ["<image>"], "answer": ["1"], "images": [[b"raw"]]},
            r"column 'images' has type list<\w+: binary>, expected list<struct<bytes: binary, "
            r"path: string>>",
        ),
        (
            {"problem": ["x"], "answer": [[1]]},
            r"column 'answer' has type list<\w+: int64>, expected string",
        ),
    ],
)
def test_parquet_schema_errors_name_the_column(tmp_path, columns, message):
    pq.write_table(pa.table(columns), tmp_path / "bad.parquet")
    with pytest.raises(ParquetSchemaError, match=message):
        load_vision_parquet(tmp_path / "bad.parquet")


def test_parquet_placeholder_count_must_match_images(tmp_path):
    path = write_vision_parquet(
        tmp_path / "p.parquet", ["ok <image>", "<image><image> two"], ["1", "2"], [[png()], [png()]]
    )
    with pytest.raises(
        ParquetSchemaError,
        match=r"row 1 has 2 <image> placeholders in column 'problem' but 1 entries in column "
        r"'images'",
    ):
        load_vision_parquet(path)


def count_blobs(image: Image.Image, rgb: tuple[int, int, int]) -> int:
    """Connected components (4-neighbour) of pixels close to ``rgb``."""
    mask = np.abs(np.asarray(image, dtype=int) - rgb).sum(-1) < 60
    seen, blobs = np.zeros_like(mask), 0
    for y, x in zip(*np.nonzero(mask), strict=True):
        if seen[y, x]:
            continue
        blobs += 1
        queue = deque([(y, x)])
        seen[y, x] = True
        while queue:
            cy, cx = queue.popleft()
            for ny, nx in ((cy + 1, cx), (cy - 1, cx), (cy, cx + 1), (cy, cx - 1)):
                if (
                    0 <= ny < mask.shape[0]
                    and 0 <= nx < mask.shape[1]
                    and mask[ny, nx]
                    and not seen[ny, nx]
                ):
                    seen[ny, nx] = True
                    queue.append((ny, nx))
    return blobs


def test_rendered_images_hold_the_stated_count():
    import random

    cfg = VisualCountingConfig()
    rng = random.Random(0)
    for count in [*range(cfg.min_count, cfg.max_count + 1)] * 4:
        image = render_shapes(rng, cfg, "red", count)
        assert image.size == (112, 112)
        assert count_blobs(image, COLORS["red"]) == count


def test_counting_task_builds_data_model_and_encodes(tmp_path):
    task = get_task("visual_counting")({"train_size": 16, "val_size": 8})
    data = task.build_data(seed=0)
    again = task.build_data(seed=0)
    assert data.train.problems == again.train.problems
    assert data.train.images[0] == again.train.images[0]
    assert len(data.train) == 16 and len(data.val) == 8
    assert all(1 <= int(a) <= 5 for a in data.train.ground_truth)
    targets = task.sft_targets(data.train)
    assert (
        targets[0] == f"<think>I count the {data.train.extra_info[0]['color']} shapes: "
        f"{data.train.ground_truth[0]}.</think><answer>{data.train.ground_truth[0]}</answer>"
    )
    processor = task.build_processor()
    model = task.build_model(processor)
    model.save_pretrained(tmp_path)
    processor.save_pretrained(tmp_path)
    vp = VisionProcessor.from_pretrained(tmp_path, DataConfig(max_prompt_length=128))
    batch = vp.encode(task.samples(data.val, vp.processor, "val"))
    assert len(batch) == 8 and batch.meta["num_filtered_prompts"] == 0
    assert (
        (batch["input_ids"] == vp.image_token_id).sum(-1) == 16
    ).all()  # 112 px -> 8x8 patches -> 16 tokens
    assert "<answer></answer>" in batch["raw_prompt"][0]
    # The tags are single tokens that survive decoding.
    tags = vp.tokenizer("<think>a</think><answer>3</answer>")["input_ids"]
    assert (
        len(tags) == 6
        and vp.tokenizer.decode(tags, skip_special_tokens=True)
        == "<think>a</think><answer>3</answer>"
    )


def test_comparison_images_hold_the_stated_counts():
    cfg = VisualComparisonConfig(min_margin=2)
    data = make_comparison_dataset(cfg, 64, seed=0)
    answers = data.ground_truth
    assert set(answers) == {"red", "green", "blue"}
    first_is_answer = [info["first"] == a for a, info in zip(answers, data.extra_info, strict=True)]
    assert 16 < sum(first_is_answer) < 48  # the answer's place in the question gives nothing away
    for problem, answer, images, info in zip(
        data.problems, answers, data.images, data.extra_info, strict=True
    ):
        other = info["second"] if info["first"] == answer else info["first"]
        assert problem == f"Are there more {info['first']} or {info['second']} shapes?<image>"
        image = load_image(images[0])
        more, fewer = count_blobs(image, COLORS[answer]), count_blobs(image, COLORS[other])
        assert (more, fewer) == (info["counts"][answer], info["counts"][other])
        assert more >= fewer + 2 and fewer >= 1


def test_comparison_task_targets_and_bad_settings():
    task = get_task("visual_comparison")({"train_size": 8, "val_size": 4})
    data = task.build_data(seed=0)
    targets = task.sft_targets(data.train)
    assert targets[0] == f"<think>compare</think><answer>{data.train.ground_truth[0]}</answer>"
    with pytest.raises(ValueError, match="do not fit a 4x4 grid"):
        make_comparison_dataset(VisualComparisonConfig(max_count=8, max_distractors=2), 1, seed=0)
    with pytest.raises(ValueError, match="at least 2 colours"):
        make_comparison_dataset(VisualComparisonConfig(colors=["red"]), 1, seed=0)


def test_parquet_task_reads_users_files(tmp_path):
    ds = make_counting_dataset(VisualCountingConfig(), 4, seed=0)
    path = write_vision_parquet(tmp_path / "c.parquet", ds.problems, ds.ground_truth, ds.images)
    counting = get_task("visual_counting")({})
    processor = counting.build_processor()
    processor.save_pretrained(tmp_path / "model")
    user = get_task("vision_parquet")(
        {"train_files": [str(path)], "model_path": str(tmp_path / "model")}
    )
    data = user.build_data(seed=0)
    assert data.train.problems == ds.problems and data.val.ground_truth == ds.ground_truth
    samples = user.samples(data.train, user.build_processor(), "train")
    assert samples[0].key == "train/0" and samples[0].prompt.count("<|image_pad|>") == 1
