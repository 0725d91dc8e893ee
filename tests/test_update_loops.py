"""The critic's update runs the PPO mini-batch loop it shares with the actor: a step with a
non-finite gradient is skipped, the weights stay finite, and the skip is reported (the
actor's side: tests/test_actor_effects.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mmrl.config import CriticConfig
from mmrl.hybrid.critic import compute_values, update_critic
from mmrl.models import policy_family
from mmrl.processors import TextProcessor
from mmrl.protocol import Batch
from mmrl.rollout.module import ModuleRollout
from mmrl.sampling import SamplingParams
from tests.conftest import save_tiny_qwen2


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory) -> Path:
    return save_tiny_qwen2(tmp_path_factory.mktemp("update") / "lm", tied=False, seed=0)


def rollout(path: Path) -> tuple[torch.nn.Module, Batch]:
    family = policy_family(path)
    model, tokenizer = family.load(path), family.load_tokenizer(path)
    prompts = TextProcessor(tokenizer, 8).encode_prompts(["1+2=", "3+4=", "5+6=", "7+8="])
    batch = ModuleRollout(model, family, tokenizer).generate(
        prompts, SamplingParams(max_tokens=3, seed=0)
    )
    batch["old_log_probs"] = batch["rollout_log_probs"]
    batch["valid_mask"] = torch.ones(len(batch), dtype=torch.bool)
    return model, batch


def poisoned(shape: torch.Size) -> torch.Tensor:
    """Ones, with row 0 NaN: the one mini-batch that holds row 0 gets a NaN gradient."""
    values = torch.ones(shape)
    values[0] = float("nan")
    return values


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_critic_skips_a_non_finite_step_and_reports_it(lm_dir):
    _, batch = rollout(lm_dir)
    family = policy_family(lm_dir)
    torch.manual_seed(0)
    critic = family.load_critic(lm_dir)
    batch["values"] = compute_values(family, critic, batch, micro_batch_size=4)
    batch["returns"] = poisoned(batch["response_mask"].shape)
    before = snapshot(critic)
    cfg = CriticConfig(ppo_micro_batch_size=1)
    optimizer = torch.optim.AdamW(critic.parameters(), lr=1e-2)
    metrics = update_critic(family, critic, optimizer, batch, cfg, mini_batch_size=2, seed=0)
    assert metrics["critic/skipped_steps"] == 1.0
    assert all(torch.isfinite(p).all() for p in critic.parameters())
    assert any(not torch.equal(p, before[n]) for n, p in critic.named_parameters())

    batch["values"] = compute_values(family, critic, batch, micro_batch_size=4)
    batch["returns"] = torch.ones(batch["response_mask"].shape)
    clean = update_critic(family, critic, optimizer, batch, cfg, mini_batch_size=2, seed=0)
    assert clean["critic/skipped_steps"] == 0.0 and clean["critic/grad_norm"] > 0
