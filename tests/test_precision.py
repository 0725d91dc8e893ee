"""``trainer.mixed_precision=auto`` and ``rollout.dtype=auto``: bf16 where the hardware has it.

bf16 matmuls are about 2x faster than fp32 on a CPU with AVX512-BF16 or AMX and about 15x
slower on one without (docs/scaling.md), so ``auto`` reads the CPU before choosing.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mmrl.config import RolloutConfig
from mmrl.hybrid import fsdp
from mmrl.hybrid.worker import COMPILE_MIN_STEPS, rollout_config
from mmrl.models import get_family


@pytest.mark.parametrize("has_bf16", [True, False])
def test_auto_is_bf16_on_a_gpu_and_on_a_cpu_with_bf16_instructions(monkeypatch, has_bf16):
    monkeypatch.setattr(fsdp, "cpu_has_bf16", lambda: has_bf16)
    assert fsdp.resolve_precision("auto", "cuda") == "bf16"
    assert fsdp.resolve_precision("auto", "cpu") == ("bf16" if has_bf16 else "fp32")
    for name in ("bf16", "fp32"):  # an explicit choice is kept on any hardware
        assert fsdp.resolve_precision(name, "cpu") == name
    policy = fsdp.mixed_precision_policy("auto", "cpu")
    if has_bf16:  # bf16 compute over fp32 parameters, gradients reduced in fp32
        assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    else:
        assert policy is None


def test_auto_keeps_fp32_for_families_whose_log_probs_are_gaussian_densities(monkeypatch):
    monkeypatch.setattr(fsdp, "cpu_has_bf16", lambda: True)
    for name in ("latent", "flow_latent"):
        family = get_family(name)
        assert not family.auto_bf16, name
        assert fsdp.resolve_precision("auto", "cpu", family.auto_bf16) == "fp32"
        assert fsdp.resolve_precision("bf16", "cpu", family.auto_bf16) == "bf16"
    for name in ("text_lm", "vlm"):
        assert fsdp.resolve_precision("auto", "cpu", get_family(name).auto_bf16) == "bf16"


def test_an_unknown_precision_names_the_key():
    with pytest.raises(ValueError, match="trainer.mixed_precision='fp8'"):
        fsdp.resolve_precision("fp8", "cpu")


def test_the_bf16_probe_agrees_with_the_cpu_flags():
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        pytest.skip("no /proc/cpuinfo to compare with")
    flags = set()
    for line in cpuinfo.read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    if "avx512_bf16" in flags:
        assert fsdp.cpu_has_bf16()
    elif not flags & {"amx_bf16", "amx_tile"}:
        assert not fsdp.cpu_has_bf16()
    # AMX without AVX512-BF16 is not a CPU that exists; torch also asks the OS for AMX there.


def test_the_engine_dtype_follows_the_actor_compute_dtype():
    auto = RolloutConfig()
    assert rollout_config(auto, "bf16", 60).dtype == "bfloat16"
    assert rollout_config(auto, "fp32", 60).dtype == "auto"  # the parameters' own dtype
    explicit = RolloutConfig(dtype="float32")
    assert rollout_config(explicit, "bf16", 60).dtype == "float32"


def test_the_engine_compiles_for_long_runs_only_unless_told():
    auto = RolloutConfig()
    assert rollout_config(auto, "fp32", COMPILE_MIN_STEPS - 1).enforce_eager is True
    assert rollout_config(auto, "bf16", COMPILE_MIN_STEPS).enforce_eager is False
    assert rollout_config(auto, "fp32", 10 * COMPILE_MIN_STEPS).enforce_eager is False
    for told in (True, False):
        for steps in (1, 10 * COMPILE_MIN_STEPS):
            cfg = RolloutConfig(enforce_eager=told)
            assert rollout_config(cfg, "bf16", steps).enforce_eager is told
