"""Session-wide fixtures: expensive things are built once per test session."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import pytest

# Two cores here: more threads only add contention.
os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# pytest-timeout's signal method fails the hung test by name and goes on, but a signal is
# handled only between Python bytecodes: a call stuck in C (a Ray or gloo wait) never sees
# it. This backstop fires a minute later, names the test and ends the run.
BACKSTOP_GRACE_S = 60.0


def _backstop(item: pytest.Item, timeout: float) -> None:
    capman = item.config.pluginmanager.getplugin("capturemanager")
    if capman is not None:
        capman.suspend_global_capture(in_=True)  # else the message goes to the capture file
    sys.stderr.write(
        f"\nTIMEOUT: {item.nodeid} hung past its {timeout:.0f} s bound and did not stop\n"
    )
    sys.stderr.flush()
    os._exit(1)


def pytest_timeout_set_timer(item, settings):
    if settings.timeout and settings.timeout > 0:
        timer = threading.Timer(
            settings.timeout + BACKSTOP_GRACE_S, _backstop, (item, settings.timeout)
        )
        timer.daemon = True
        timer.start()
        item._mmrl_backstop = timer
    # None: pytest-timeout still sets its own timer.


def pytest_timeout_cancel_timer(item):
    timer = getattr(item, "_mmrl_backstop", None)
    if timer is not None:
        timer.cancel()


def run_overrides(output_dir: Path, *extra: str) -> list[str]:
    """Overrides for a quiet, short text GRPO run writing to ``output_dir``."""
    return [
        f"trainer.output_dir={output_dir}",
        "trainer.progress_bar=false",
        "trainer.loggers=[jsonl]",
        *extra,
    ]


def assert_rollout_matches_actor(
    series, mixed_precision: str = "auto", bf16_mean_gap: float = 5e-3
) -> None:
    """The rollout engine sampled from the policy being trained. ``series(key)`` gives a
    metric's values over steps (``FitResult.series``). In fp32 every sampled token's
    log-prob matches the actor's to 1e-3. In bf16 (``auto`` on a CPU with bf16
    instructions) the two sides round in different kernel orders, so the mean gap per step
    is held under ``bf16_mean_gap`` instead (the transformers engine, which runs the actor's
    own module: at most 2.5e-3 measured for text GRPO, its largest token 0.08)."""
    from mmrl.hybrid.fsdp import resolve_precision

    if resolve_precision(mixed_precision, "cpu") == "fp32":
        assert max(series("rollout/logprob_diff_max")) < 1e-3
    else:
        assert max(series("rollout/logprob_diff_mean")) < bf16_mean_gap


@pytest.fixture(scope="session")
def warm_model_dir(tmp_path_factory) -> Path:
    """A tiny addition model after the default SFT warm-up, saved with save_pretrained."""
    from mmrl.config import load_config
    from mmrl.tasks import get_task
    from mmrl.trainer.fit import prepare_initial_model
    from mmrl.utils.seed import set_seed

    out = tmp_path_factory.mktemp("warm")
    cfg = load_config(run_overrides(out))
    set_seed(cfg.trainer.seed)  # as fit() does: the model must not depend on which tests ran first
    path, _ = prepare_initial_model(cfg, get_task("text_addition")(cfg.task))
    return path


# --- vLLM rollout: tiny Qwen2 models and one engine per model, built once -------------


def save_tiny_qwen2(path: Path, tied: bool, seed: int = 0) -> Path:
    """Save a random 2-layer Qwen2 (hidden 64, head_dim 64) and the char tokenizer to ``path``.

    head_dim 64 because the vLLM CPU attention kernel refuses small heads (16).
    """
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from mmrl.tasks.text_addition import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=1,
        num_key_value_heads=1,
        max_position_embeddings=128,
        tie_word_embeddings=tied,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    torch.manual_seed(seed)
    Qwen2ForCausalLM(config).save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def small_token_wm_cache(tmp_path_factory) -> Path:
    """One ``task.cache_dir`` for the small token world-model base (tests/test_worldmodel_rl.py's
    ``small_pretraining``): the first test to run pretrains it, later ones hit the cache."""
    return tmp_path_factory.mktemp("small_token_wm")


@pytest.fixture(scope="session")
def tiny_lm_dirs(tmp_path_factory) -> dict[str, Path]:
    """``{"untied": dir, "tied": dir}``: tiny Qwen2 models with and without tied embeddings."""
    return {
        kind: save_tiny_qwen2(tmp_path_factory.mktemp(kind), tied=kind == "tied")
        for kind in ("untied", "tied")
    }


@pytest.fixture(scope="session")
def vllm_rollouts(tiny_lm_dirs):
    """``{kind: (actor, tokenizer, engine)}``: an fp32 HF actor and the vLLM engine serving it.

    Tests that change the actor's weights must call ``engine.sync_weights(actor)``.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mmrl.config import RolloutConfig
    from mmrl.models import get_family
    from mmrl.rollout.vllm import VLLMRollout

    cfg = RolloutConfig(name="vllm", dtype="float32", kv_cache_memory_gib=0.125)
    out = {}
    for kind, path in tiny_lm_dirs.items():
        actor = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        engine = VLLMRollout(
            model=actor,
            family=get_family("text_lm"),
            tokenizer=tokenizer,
            model_path=str(path),
            cfg=cfg,
            max_model_len=64,
        )
        out[kind] = (actor, tokenizer, engine)
    return out
