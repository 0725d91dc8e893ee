import json
import math

import numpy as np
import pytest
import torch
from safetensors import safe_open

from mmrl.protocol import Batch
from mmrl.utils.batch_io import FORMAT_VERSION, JSON_FILE, TENSORS_FILE


def make_batch(n: int = 5) -> Batch:
    return Batch.from_dict(
        tensors={
            "input_ids": torch.arange(n * 3).view(n, 3),
            "scores": torch.linspace(0, 1, n, dtype=torch.bfloat16),
            "mask": torch.arange(n) % 2 == 0,
        },
        non_tensor={
            "uid": [f"u{i}" for i in range(n)],
            "ground_truth": [[i, i + 1] for i in range(n)],  # list of lists must stay 1-D
        },
        meta={"temperature": 0.7},
    )


def same(a, b) -> bool:
    """Structural equality written independently of mmrl.protocol; NaN == NaN."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return (
            isinstance(b, np.ndarray)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and all(same(x, y) for x, y in zip(a.ravel(), b.ravel(), strict=True))
        )
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    return type(a) is type(b) and a == b


def assert_same_batch(a: Batch, b: Batch) -> None:
    assert len(a) == len(b)
    assert a.keys() == b.keys() and list(a.non_tensor) == list(b.non_tensor)
    for k in [*a.keys(), *a.non_tensor]:
        assert same(a[k], b[k]), k
    assert same(a.meta, b.meta)


def uids(batch: Batch) -> list[str]:
    return list(batch["uid"])


# ----- construction and access -------------------------------------------------------


def test_from_dict_and_access():
    b = make_batch(4)
    assert len(b) == b.batch_size == 4
    assert b.keys() == ["input_ids", "scores", "mask"]
    assert "uid" in b and "input_ids" in b and "missing" not in b
    assert b["ground_truth"].shape == (4,) and b["ground_truth"].dtype == object
    assert b["ground_truth"][2] == [2, 3]
    assert b["input_ids"].shape == (4, 3)
    assert b.meta == {"temperature": 0.7}
    assert "B=4" in repr(b) and "input_ids: [4, 3] int64" in repr(b)


@pytest.mark.parametrize(
    ("tensors", "non_tensor", "match"),
    [
        (
            {"a": torch.zeros(3), "b": torch.zeros(2, 5)},
            None,
            "tensor 'b' has length 2, expected 3",
        ),
        ({"a": torch.zeros(3)}, {"uid": ["x", "y"]}, "non_tensor 'uid' has length 2, expected 3"),
        (None, {"uid": ["x"], "gt": [1, 2]}, "non_tensor 'gt' has length 2, expected 1"),
    ],
)
def test_from_dict_length_mismatch_names_key(tensors, non_tensor, match):
    with pytest.raises(ValueError, match=match):
        Batch.from_dict(tensors, non_tensor)


def test_from_dict_rejects_bad_field_types():
    with pytest.raises(TypeError, match=r"tensors \['a'\] are not torch.Tensor"):
        Batch.from_dict({"a": [1, 2]})
    with pytest.raises(TypeError, match="non_tensor 'uid' must be a Tensor, np.ndarray or list"):
        Batch.from_dict({"a": torch.zeros(3)}, non_tensor={"uid": "abc"})
    with pytest.raises(TypeError, match="field 'uid' must be a Tensor, np.ndarray or list"):
        Batch.from_dict(non_tensor={"uid": "abc"})
    with pytest.raises(ValueError, match="0-d"):
        Batch.from_dict({"a": torch.tensor(1.0)})


def test_setitem_and_getitem():
    b = make_batch(3)
    b["rewards"] = torch.tensor([1.0, 2.0, 3.0])
    b["extra"] = np.array([1, 2, 3])
    b["notes"] = ["a", "b", "c"]
    assert b.keys()[-1] == "rewards" and torch.equal(b["rewards"], torch.tensor([1.0, 2.0, 3.0]))
    assert b["extra"].dtype == object and list(b["extra"]) == [1, 2, 3]
    as_values = Batch.from_dict(non_tensor={"t": torch.arange(6).view(3, 2)})
    assert as_values.keys() == [] and torch.equal(as_values["t"][2], torch.tensor([4, 5]))
    with pytest.raises(ValueError, match="tensor 'bad' has length 2, expected 3"):
        b["bad"] = torch.zeros(2)
    with pytest.raises(ValueError, match="non_tensor 'bad' has length 4, expected 3"):
        b["bad"] = [1, 2, 3, 4]
    with pytest.raises(
        ValueError, match="cannot set tensor 'uid': it already names a non_tensor field"
    ):
        b["uid"] = torch.zeros(3)
    with pytest.raises(KeyError, match="no field 'nope'.*input_ids.*uid"):
        b["nope"]


# ----- row selection ------------------------------------------------------------------


def test_indexing_kinds():
    b = make_batch(5)
    assert uids(b[1]) == ["u1"] and b[1]["input_ids"].shape == (1, 3)
    assert uids(b[-1]) == ["u4"]
    assert uids(b[1:4:2]) == ["u1", "u3"]
    assert uids(b[::-1]) == ["u4", "u3", "u2", "u1", "u0"]
    assert torch.equal(b[::-1]["input_ids"], b["input_ids"].flip(0))
    assert uids(b[torch.tensor([4, 0])]) == ["u4", "u0"]
    assert torch.equal(b[np.array([4, 0])]["input_ids"], b["input_ids"][[4, 0]])
    assert uids(b[[2, -1]]) == ["u2", "u4"]
    mask = np.array([True, False, True, False, False])
    assert uids(b[mask]) == ["u0", "u2"] and uids(b[torch.from_numpy(mask)]) == ["u0", "u2"]
    assert b[mask]["ground_truth"][1] == [2, 3]
    assert b[1:3].meta == b.meta and b[1:3].meta is not b.meta
    with pytest.raises(IndexError, match="row 5 is out of range for a Batch of 5 rows"):
        b[5]
    with pytest.raises(IndexError, match=r"expected \(5,\)"):
        b[np.array([True, False])]
    with pytest.raises(IndexError, match="out of range"):
        b[[0, 7]]


def test_row_and_iteration():
    b = make_batch(3)
    row = b.row(-1)
    assert row["uid"] == "u2" and row["ground_truth"] == [2, 3]
    assert torch.equal(row["input_ids"], torch.tensor([6, 7, 8]))
    assert [r["uid"] for r in b] == ["u0", "u1", "u2"]


def test_concat_order_and_meta():
    b = make_batch(5)
    other = b[3:]
    other.meta = {"temperature": 1.0}
    out = Batch.concat([b[:3], other])
    assert_same_batch(out, b)  # meta comes from the first batch
    assert out.meta == {"temperature": 0.7}


def test_concat_rejects_mismatched_keys_and_shapes():
    b = make_batch(4)
    with pytest.raises(ValueError, match=r"batch 1 and batch 0 differ in tensor keys \['mask'\]"):
        Batch.concat([b, b.select(tensor_keys=["input_ids", "scores"])])
    with pytest.raises(ValueError, match=r"differ in non_tensor keys \['uid'\]"):
        Batch.concat([b, b.select(non_tensor_keys=["ground_truth"])])
    wide = b.clone()
    wide.tensors["input_ids"] = torch.zeros(4, 7, dtype=torch.int64)
    with pytest.raises(ValueError, match="tensor 'input_ids' is \\[4, 7\\]"):
        Batch.concat([b, wide])
    with pytest.raises(ValueError, match="at least one"):
        Batch.concat([])


def test_chunk_and_split():
    b = make_batch(6)
    assert [uids(c) for c in b.chunk(3)] == [["u0", "u1"], ["u2", "u3"], ["u4", "u5"]]
    assert [len(c) for c in b.split(4)] == [4, 2]
    assert uids(b.split(4)[1]) == ["u4", "u5"]
    with pytest.raises(ValueError, match=r"cannot chunk 6 rows into 4.*pad_to_divisor\(4\)"):
        b.chunk(4)
    with pytest.raises(ValueError, match="split size"):
        b.split(0)


def test_pad_chunk_concat_unpad_round_trip():
    b = make_batch(5)
    padded, pad = b.pad_to_divisor(4)
    assert pad == 3 and len(padded) == 8
    # pad rows cycle from the start and carry every per-sample field
    assert uids(padded) == ["u0", "u1", "u2", "u3", "u4", "u0", "u1", "u2"]
    assert padded["ground_truth"][6] == [1, 2]
    assert torch.equal(padded["input_ids"][5:], b["input_ids"][:3])
    assert torch.equal(padded["mask"][5:], b["mask"][:3])
    restored = Batch.concat(padded.chunk(4)).unpad(pad)
    assert_same_batch(restored, b)
    same_batch, zero = b.pad_to_divisor(5)
    assert zero == 0 and same_batch is b
    small, pad = b[:2].pad_to_divisor(7)  # more pad than rows: cycle repeatedly
    assert pad == 5 and uids(small) == ["u0", "u1"] * 3 + ["u0"]
    with pytest.raises(ValueError, match="pad_size"):
        b.unpad(6)


def test_repeat_interleave_and_tile():
    b = make_batch(2)
    inter, tile = b.repeat(2), b.repeat(2, interleave=False)
    assert uids(inter) == ["u0", "u0", "u1", "u1"]
    assert uids(tile) == ["u0", "u1", "u0", "u1"]
    assert inter["input_ids"][:, 0].tolist() == [0, 0, 3, 3]
    assert tile["input_ids"][:, 0].tolist() == [0, 3, 0, 3]
    assert list(inter["ground_truth"]) == [[0, 1], [0, 1], [1, 2], [1, 2]]
    with pytest.raises(ValueError, match="repeat count"):
        b.repeat(0)


def test_reorder_in_place():
    b = make_batch(4)
    ids = b["input_ids"].clone()
    assert b.reorder(torch.tensor([2, 0, 3, 1])) is b
    assert uids(b) == ["u2", "u0", "u3", "u1"]
    assert torch.equal(b["input_ids"], ids[[2, 0, 3, 1]])
    b.reorder(np.array([1, 3, 0, 2]))
    assert uids(b) == ["u0", "u1", "u2", "u3"]
    with pytest.raises(ValueError, match="permutation of range\\(4\\)"):
        b.reorder([0, 0, 1, 2])


# ----- key operations -----------------------------------------------------------------


def test_union_merges_and_checks_shared_keys():
    b = make_batch(3)
    extra = Batch.from_dict(
        {"input_ids": b["input_ids"].clone(), "rewards": torch.ones(3)},
        {"uid": ["u0", "u1", "u2"], "score_info": [{"acc": 1.0}] * 3},
        {"step": 4, "temperature": 0.7},
    )
    merged = b.union(extra)
    assert merged.keys() == ["input_ids", "scores", "mask", "rewards"]
    assert set(merged.non_tensor) == {"uid", "ground_truth", "score_info"}
    assert merged.meta == {"temperature": 0.7, "step": 4}
    assert "rewards" not in b  # union returns a new Batch

    bad = extra.clone()
    bad["input_ids"][0, 0] = -1
    with pytest.raises(ValueError, match="tensor key 'input_ids'"):
        b.union(bad)
    bad_uid = Batch.from_dict(non_tensor={"uid": ["u0", "u1", "zz"]})
    with pytest.raises(ValueError, match="non_tensor key 'uid'"):
        b.union(bad_uid)
    bad_meta = Batch.from_dict(non_tensor={"uid": uids(b)}, meta={"temperature": 1.0})
    with pytest.raises(ValueError, match="meta key 'temperature'"):
        b.union(bad_meta)
    with pytest.raises(ValueError, match="other has 2 rows, expected 3"):
        b.union(b[:2])
    with pytest.raises(ValueError, match=r"\['uid'\] are tensors in one"):
        b.union(Batch.from_dict({"uid": torch.zeros(3)}))


def test_select():
    b = make_batch(3)
    s = b.select(tensor_keys=["scores"], non_tensor_keys=["uid"], meta_keys=[])
    assert s.keys() == ["scores"] and list(s.non_tensor) == ["uid"] and s.meta == {}
    assert len(s) == 3
    everything = b.select()
    assert_same_batch(everything, b)
    assert len(b.select(tensor_keys=[], non_tensor_keys=[])) == 3  # no fields, length kept
    with pytest.raises(KeyError, match=r"unknown tensor keys \['nope'\].*input_ids"):
        b.select(tensor_keys=["nope"])
    with pytest.raises(KeyError, match=r"unknown non_tensor keys \['nope'\].*uid"):
        b.select(non_tensor_keys=["nope"])
    with pytest.raises(KeyError, match="unknown meta keys"):
        b.select(meta_keys=["nope"])


def test_pop_removes_from_source():
    b = make_batch(3)
    scores = b["scores"].clone()
    popped = b.pop(
        tensor_keys=["scores"], non_tensor_keys=["ground_truth"], meta_keys=["temperature"]
    )
    assert popped.keys() == ["scores"] and list(popped.non_tensor) == ["ground_truth"]
    assert popped.meta == {"temperature": 0.7} and torch.equal(popped["scores"], scores)
    assert b.keys() == ["input_ids", "mask"] and list(b.non_tensor) == ["uid"] and b.meta == {}
    assert len(b) == 3
    with pytest.raises(KeyError, match="unknown tensor keys"):
        b.pop(tensor_keys=["scores"])
    assert b.keys() == ["input_ids", "mask"]  # a failed pop removes nothing


def test_to_and_clone():
    b = make_batch(3)
    moved = b.to("cpu")
    assert moved["input_ids"].device.type == "cpu" and uids(moved) == uids(b)
    c = b.clone()
    c["input_ids"][0, 0] = 100
    c["ground_truth"][0].append(99)
    c.meta["temperature"] = 2.0
    assert b["input_ids"][0, 0] == 0 and b["ground_truth"][0] == [0, 1]
    assert b.meta["temperature"] == 0.7


# ----- save / load --------------------------------------------------------------------


def rich_batch() -> Batch:
    return Batch.from_dict(
        tensors={
            "logp": torch.randn(2, 4, dtype=torch.bfloat16),
            "ids": torch.arange(8, dtype=torch.int64).view(2, 4)[:, ::2],  # non-contiguous view
            "mask": torch.tensor([True, False]),
        },
        non_tensor={
            "uid": ["a", "b"],
            "image": [b"\x89PNG\x00\xff", b""],
            "extra_info": [
                {
                    "nested": {"list": [1, 2.5, None, True, "s"], "tuple": (1, 2)},
                    "nan": float("nan"),
                    "inf": [float("inf"), float("-inf")],
                    "arr": np.arange(6, dtype=np.uint8).reshape(2, 3),
                    "flags": np.array([True, False]),
                    "t": torch.ones(2, 2, dtype=torch.bfloat16),
                    "np_scalar": np.float32(1.5),
                },
                None,
            ],
        },
        meta={"sampling": {"temperature": 0.7, "n": 4}, "loss": float("nan"), "w": torch.zeros(3)},
    )


def test_save_load_round_trip(tmp_path):
    b = rich_batch()
    b.save(tmp_path / "batch")
    loaded = Batch.load(tmp_path / "batch")
    assert loaded["logp"].dtype == torch.bfloat16 and torch.equal(loaded["logp"], b["logp"])
    assert loaded["ids"].dtype == torch.int64 and torch.equal(loaded["ids"], b["ids"])
    assert loaded["mask"].dtype == torch.bool and loaded["mask"].tolist() == [True, False]
    assert list(loaded["uid"]) == ["a", "b"]
    assert list(loaded["image"]) == [b"\x89PNG\x00\xff", b""]
    info, want = loaded["extra_info"][0], b["extra_info"][0]
    assert info["nested"] == {"list": [1, 2.5, None, True, "s"], "tuple": [1, 2]}  # tuple -> list
    assert math.isnan(info["nan"]) and info["inf"] == [math.inf, -math.inf]
    assert same(info["arr"], want["arr"]) and info["arr"].dtype == np.uint8
    assert same(info["flags"], want["flags"])
    assert same(info["t"], want["t"]) and info["t"].dtype == torch.bfloat16
    assert info["np_scalar"] == 1.5 and isinstance(info["np_scalar"], float)
    assert loaded["extra_info"][1] is None
    assert loaded.meta["sampling"] == {"temperature": 0.7, "n": 4}
    assert math.isnan(loaded.meta["loss"]) and same(loaded.meta["w"], torch.zeros(3))


def test_saved_files_are_json_and_safetensors(tmp_path):
    rich_batch().save(tmp_path)
    doc = json.loads((tmp_path / JSON_FILE).read_text())
    assert doc["format_version"] == FORMAT_VERSION and doc["batch_size"] == 2
    with safe_open(str(tmp_path / TENSORS_FILE), framework="pt") as f:
        names = set(f.keys())
    assert {"tensors/logp", "tensors/ids", "tensors/mask"} <= names
    assert len(names) == 3 + 4  # arr, flags, t in extra_info and w in meta
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([JSON_FILE, TENSORS_FILE])
    for name in (JSON_FILE, TENSORS_FILE):
        assert not (tmp_path / name).read_bytes().startswith(b"\x80")  # pickle protocol >= 2


@pytest.mark.parametrize(
    ("value", "found"),
    [({"obj": object()}, "object"), ({"s": {1, 2}}, "set"), ({"a": np.array(["x"])}, "dtype <U1")],
)
def test_save_unsupported_value_names_field_and_sample(tmp_path, value, found):
    b = Batch.from_dict(non_tensor={"extra_info": [{}, value]})
    with pytest.raises(TypeError, match=f"non_tensor field 'extra_info', sample 1 at .*{found}"):
        b.save(tmp_path / "out")
    assert not (tmp_path / "out").exists()  # nothing half-written


def test_save_rejects_bad_dict_keys_and_meta(tmp_path):
    with pytest.raises(TypeError, match="sample 0 at .*dict key 3 must be a str"):
        Batch.from_dict(non_tensor={"x": [{3: "a"}]}).save(tmp_path)
    with pytest.raises(TypeError, match="dict key '__tensor__'"):
        Batch.from_dict(non_tensor={"x": [{"__tensor__": "a"}]}).save(tmp_path)
    with pytest.raises(TypeError, match=r"meta at \['fn'\]: type function"):
        Batch.from_dict(meta={"fn": lambda: 0}).save(tmp_path)


def test_load_checks_format_version_and_files(tmp_path):
    make_batch(2).save(tmp_path)
    doc = json.loads((tmp_path / JSON_FILE).read_text())
    doc["format_version"] = FORMAT_VERSION + 1
    (tmp_path / JSON_FILE).write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=f"format_version {FORMAT_VERSION + 1} is not supported"):
        Batch.load(tmp_path)
    with pytest.raises(FileNotFoundError, match="expected files"):
        Batch.load(tmp_path / "missing")


# ----- empty batch --------------------------------------------------------------------


def test_empty_batch(tmp_path):
    e = Batch.from_dict()
    assert len(e) == 0 and e.keys() == [] and list(e) == []
    b = make_batch(3)[:0]
    assert len(b) == 0 and b["input_ids"].shape == (0, 3) and b["uid"].shape == (0,)
    assert b.split(2) == [] and [len(c) for c in b.chunk(2)] == [0, 0]
    assert b.pad_to_divisor(4) == (b, 0) and len(b.repeat(3)) == 0
    assert len(Batch.concat([b, make_batch(2)])) == 2
    b.save(tmp_path)
    loaded = Batch.load(tmp_path)
    assert_same_batch(loaded, b)
