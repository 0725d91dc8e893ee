"""Deterministic LPIPS test image pairs, shared by the golden-value script and the tests.

Pure numpy with exact arithmetic only (uniform draws, repeat, add, multiply, clip), so
the JAX environment that makes the golden values and mmrl's environment build
bit-identical inputs; ``inputs_sha256`` lets both sides check that they did.
Images are float32 NHWC in [-1, 1], the range LPIPS expects.
"""

from __future__ import annotations

import hashlib

import numpy as np

SEED = 20240607
# (name, height, width, distortion, strength)
PAIRS = [
    ("identical", 64, 64, "none", 0.0),
    ("noise_small", 64, 64, "noise", 0.05),
    ("noise_medium", 64, 64, "noise", 0.2),
    ("noise_large", 64, 64, "noise", 0.5),
    ("shift_2px", 64, 64, "shift", 2.0),
    ("unrelated", 64, 64, "unrelated", 0.0),
    ("noise_nonsquare", 48, 80, "noise", 0.1),
    ("noise_128", 128, 128, "noise", 0.15),
]


def _smooth_image(rng: np.random.Generator, h: int, w: int) -> np.ndarray:
    """A blocky random image [h, w, 3] in [-1, 1], blurred by averaging shifted copies."""
    coarse = rng.random((h // 8 + 1, w // 8 + 1, 3)) * 2.0 - 1.0
    img = np.repeat(np.repeat(coarse, 8, axis=0), 8, axis=1)[:h, :w]
    blurred = np.zeros_like(img)
    for dy in range(-2, 3):
        for dx in range(-2, 3):
            blurred += np.roll(img, (dy, dx), axis=(0, 1))
    return blurred / 25.0


def make_pairs() -> list[tuple[str, np.ndarray, np.ndarray]]:
    """``[(name, image_0 [1, H, W, 3], image_1 [1, H, W, 3])]``, float32 in [-1, 1]."""
    rng = np.random.default_rng(SEED)
    out = []
    for name, h, w, kind, strength in PAIRS:
        a = _smooth_image(rng, h, w)
        detail = (rng.random((h, w, 3)) * 2.0 - 1.0) * 0.1
        a = np.clip(a + detail, -1.0, 1.0)
        if kind == "none":
            b = a.copy()
        elif kind == "noise":
            b = a + (rng.random(a.shape) * 2.0 - 1.0) * strength
        elif kind == "shift":
            b = np.roll(a, (int(strength), int(strength)), axis=(0, 1))
        elif kind == "unrelated":
            b = _smooth_image(rng, h, w)
        else:
            raise ValueError(f"unknown distortion {kind!r}")
        b = np.clip(b, -1.0, 1.0)
        out.append((name, a[None].astype(np.float32), b[None].astype(np.float32)))
    return out


def inputs_sha256(pairs: list[tuple[str, np.ndarray, np.ndarray]]) -> str:
    """One digest over every pair's name, shape and float32 bytes."""
    digest = hashlib.sha256()
    for name, a, b in pairs:
        digest.update(name.encode())
        for x in (a, b):
            digest.update(str(x.shape).encode())
            digest.update(np.ascontiguousarray(x, dtype=np.float32).tobytes())
    return digest.hexdigest()
