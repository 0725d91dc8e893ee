"""Data from elsewhere is untrusted: media paths stay inside the dataset's folder, oversized media
is refused before it is decoded, damaged media is a named error, and no file goes through pickle.
"""

from __future__ import annotations

import ast
import io
import struct
import zlib
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from mmrl.config import DataConfig
from mmrl.data import UnsafeMediaPathError, load_vision_parquet
from mmrl.data.parquet import MEDIA_STRUCT
from mmrl.processors import VisionProcessor, VisionSample, chat_prompt
from mmrl.processors.media import MediaReadError, MediaTooLargeError, load_image, read_video
from mmrl.worldmodel.video import write_mp4

MMRL = Path(__file__).resolve().parents[1] / "mmrl"


def png_header_only(width: int, height: int) -> bytes:
    """A PNG that claims ``width x height`` pixels but holds no pixel data: a bomb's header."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")


def png(size: int = 28) -> bytes:
    """Noise, so the encoded size grows with the pixel count (about 3 bytes a pixel)."""
    pixels = np.random.default_rng(0).integers(0, 255, (size, size, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def parquet_with_path(folder: Path, media_path: str) -> Path:
    table = pa.table(
        {
            "problem": pa.array(["what is <image>?"]),
            "answer": pa.array(["1"]),
            "images": pa.array([[{"bytes": None, "path": media_path}]], pa.list_(MEDIA_STRUCT)),
        }
    )
    pq.write_table(table, folder / "data.parquet")
    return folder / "data.parquet"


# ----- paths ---------------------------------------------------------------------------------


@pytest.mark.parametrize("media_path", ["../../secret.png", "sub/../../secret.png", "/etc/passwd"])
def test_parquet_media_path_outside_its_folder_is_refused(tmp_path, media_path):
    (tmp_path / "secret.png").write_bytes(png())
    folder = tmp_path / "a" / "b"
    folder.mkdir(parents=True)
    path = parquet_with_path(folder, media_path)
    with pytest.raises(UnsafeMediaPathError, match=r"row 0, entry 0: media path .* is outside"):
        load_vision_parquet(path)


def test_parquet_media_path_inside_its_folder_is_kept(tmp_path):
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "a.png").write_bytes(png())
    ds = load_vision_parquet(parquet_with_path(tmp_path, "img/./a.png"))
    assert ds.images[0] == [str(tmp_path / "img" / "a.png")]
    assert load_image(ds.images[0][0]).size == (28, 28)


# ----- size refusals, before decoding ----------------------------------------------------------


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
def test_image_over_the_pixel_limit_is_refused_from_its_header():
    # 10000 x 10000 is above mmrl's default limit but below PIL's own error: only mmrl refuses.
    # The file has no pixel data, so reaching the decoder would be a MediaReadError instead.
    bomb = png_header_only(10_000, 10_000)
    limit = DataConfig().max_image_pixels
    with pytest.raises(MediaTooLargeError, match=r"10000x10000 .* data.max_image_pixels"):
        load_image(bomb, max_pixels=limit)
    with pytest.raises(MediaTooLargeError):  # PIL's own bomb check, past every mmrl limit
        load_image(png_header_only(100_000, 100_000), max_pixels=None)


def test_image_over_the_byte_limit_is_refused(tmp_path):
    data = png()
    (tmp_path / "a.png").write_bytes(data)
    for source in (data, tmp_path / "a.png"):
        with pytest.raises(MediaTooLargeError, match=r"data.max_image_bytes=100\b"):
            load_image(source, max_bytes=100)
        assert load_image(source, max_bytes=len(data)).size == (28, 28)


def test_video_with_too_many_frames_is_refused_before_decoding(tmp_path):
    frames = np.zeros((12, 32, 32, 3), np.uint8)
    path = write_mp4(tmp_path / "v.mp4", frames, fps=10)
    with pytest.raises(MediaTooLargeError, match=r"12 frames, over data.max_video_frames=10"):
        read_video(path, fps=2, min_frames=2, max_frames=4, max_video_frames=10)
    got, _ = read_video(path, fps=2, min_frames=2, max_frames=4, max_video_frames=12)
    assert got.shape[1:] == (32, 32, 3)


def test_damaged_media_is_a_named_error(tmp_path):
    with pytest.raises(MediaReadError, match="cannot be decoded"):
        load_image(png()[:40])  # header and a cut pixel stream
    with pytest.raises(MediaReadError, match="cannot be decoded"):
        load_image(b"not an image at all")
    path = write_mp4(tmp_path / "v.mp4", np.zeros((6, 32, 32, 3), np.uint8), fps=10)
    (tmp_path / "cut.mp4").write_bytes(path.read_bytes()[:300])
    with pytest.raises(MediaReadError, match=r"video \(file .*cut.mp4\) cannot be decoded"):
        read_video(tmp_path / "cut.mp4", fps=2, min_frames=2, max_frames=4)


def test_processor_refuses_by_the_data_keys_and_names_the_sample(tmp_path):
    from mmrl.models.tiny_vlm import build_tiny_qwen2_vl

    model_dir = build_tiny_qwen2_vl(tmp_path / "vlm")
    proc = VisionProcessor.from_pretrained(
        model_dir, DataConfig(max_prompt_length=96, max_image_pixels=28 * 28)
    )
    ok = VisionSample(chat_prompt(proc.processor, "<image> count"), images=[png(28)])
    big = VisionSample(chat_prompt(proc.processor, "<image> count"), images=[png(56)])
    proc.encode([ok])
    with pytest.raises(MediaTooLargeError, match=r"sample 1: image .* 56x56 = 3136 pixels"):
        proc.encode([ok, big])


# ----- no pickle for files -------------------------------------------------------------------

# The only places in mmrl/ that may unpickle, each with its reason.
PICKLE_ALLOWED = {
    "verifiers/pool.py": "IPC between mmrl's own trainer and verifier worker processes; the "
    "bytes never come from a file",
    "verifiers/lpips_weights.py": "NumpyOnlyUnpickler converts the LPIPS weights: a restricted "
    "unpickler that refuses every global but numpy arrays",
}
PICKLE_MODULES = {"pickle", "cPickle", "_pickle", "cloudpickle", "dill", "joblib", "shelve"}


def unsafe_loads(tree: ast.AST) -> list[str]:
    """Calls that can run code from a file's bytes: pickle-family loads, torch.load without
    ``weights_only=True``, numpy/pandas loads that allow pickle."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = ast.unparse(node.func)
        keywords = {k.arg: k.value for k in node.keywords}
        root = name.split(".")[0]
        if root in PICKLE_MODULES and name.rsplit(".", 1)[-1] in ("load", "loads", "Unpickler"):
            found.append(name)
        elif name.endswith("torch.load") or name == "load" and "weights_only" in keywords:
            weights_only = keywords.get("weights_only")
            if not (isinstance(weights_only, ast.Constant) and weights_only.value is True):
                found.append(f"{name} without weights_only=True")
        elif name.endswith(("np.load", "numpy.load")) and "allow_pickle" in keywords:
            value = keywords["allow_pickle"]
            if not (isinstance(value, ast.Constant) and value.value is False):
                found.append(f"{name} with allow_pickle")
        elif name.endswith(("read_pickle", "Unpickler")):
            found.append(name)
    for node in ast.walk(tree):  # a subclass of pickle.Unpickler is an unpickler too
        if isinstance(node, ast.ClassDef):
            found += [ast.unparse(b) for b in node.bases if ast.unparse(b).endswith("Unpickler")]
    return found


def test_no_file_is_loaded_through_pickle():
    offenders, used = {}, set()
    for path in sorted(MMRL.rglob("*.py")):
        rel = path.relative_to(MMRL).as_posix()
        calls = unsafe_loads(ast.parse(path.read_text(), filename=str(path)))
        if calls and rel in PICKLE_ALLOWED:
            used.add(rel)
        elif calls:
            offenders[rel] = calls
    assert not offenders, f"unpickling outside the allowed places: {offenders}"
    # The list stays exact: an allowed place that no longer unpickles is removed from it.
    assert used == set(PICKLE_ALLOWED), set(PICKLE_ALLOWED) - used


def test_the_pickle_check_finds_what_it_forbids():
    bad = """
import pickle, torch, numpy as np
pickle.load(open("x", "rb"))
torch.load("w.pt")
torch.load("w.pt", weights_only=False)
np.load("a.npy", allow_pickle=True)
class U(pickle.Unpickler): pass
"""
    assert len(unsafe_loads(ast.parse(bad))) == 5
    good = 'import torch\ntorch.load("w.pt", weights_only=True)\nimport numpy as np\nnp.load("a")'
    assert unsafe_loads(ast.parse(good)) == []
