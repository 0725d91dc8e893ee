"""The actor update reads the loss settings from the actor config as the YAML filled it."""

from __future__ import annotations

import pytest
import torch

from mmrl.config import ActorConfig, PolicyLossConfig
from mmrl.hybrid.actor import compute_log_probs, update_policy
from mmrl.models import get_family
from mmrl.protocol import Batch
from mmrl.tasks import get_task
from mmrl.tasks.text_addition import build_char_tokenizer

TEXT_LM = get_family("text_lm")


def tiny_policy(seed: int = 0):
    task = get_task("text_addition")({"name": "text_addition"})
    tokenizer = build_char_tokenizer()
    torch.manual_seed(seed)
    return task.build_model(tokenizer), len(tokenizer)


def ppo_batch(model, vocab: int, n: int = 6, prompt_len: int = 4, response_len: int = 5) -> Batch:
    """Responses of different lengths, one invalid sample, old log-probs near the model's."""
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(3, vocab, (n, prompt_len), generator=g)
    responses = torch.randint(3, vocab, (n, response_len), generator=g)
    lengths = torch.tensor([5, 1, 3, 2, 5, 4])[:n]
    response_mask = (torch.arange(response_len)[None] < lengths[:, None]).float()
    batch = Batch.from_dict(
        {
            "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": torch.cat([torch.ones(n, prompt_len), response_mask], 1).long(),
            "position_ids": torch.arange(prompt_len + response_len).expand(n, -1).clone(),
            "responses": responses,
            "response_mask": response_mask,
            "advantages": torch.randn(n, 1, generator=g).expand(n, response_len) * response_mask,
            "valid_mask": torch.arange(n) != 3,
        }
    )
    own = compute_log_probs(TEXT_LM, model, batch, micro_batch_size=n, temperature=1.0)
    batch["old_log_probs"] = own + 0.05 * torch.randn(n, response_len, generator=g)
    batch["ref_log_prob"] = own - 0.05 * torch.randn(n, response_len, generator=g)
    return batch


def updated_weights(cfg: ActorConfig) -> list[torch.Tensor]:
    model, vocab = tiny_policy()
    batch = ppo_batch(model, vocab)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    update_policy(TEXT_LM, model, optimizer, batch, cfg, mini_batch_size=6, temperature=1.0, seed=0)
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("loss_mode", ["gspo", "vanilla", "cispo"])
def test_splitting_a_mini_batch_into_micro_batches_changes_nothing(loss_mode: str):
    # GSPO aggregates per sequence while the entropy and KL terms follow actor.loss_agg_mode:
    # each term's micro-batches are weighted by its own aggregation's denominator.
    knobs = PolicyLossConfig(loss_mode, gspo_clip_ratio_low=0.5, gspo_clip_ratio_high=0.5)

    def cfg(micro: int) -> ActorConfig:
        return ActorConfig(
            ppo_micro_batch_size=micro,
            loss_agg_mode="token-mean",
            policy_loss=knobs,
            entropy_coeff=0.01,
            grad_clip=1e9,
        )

    whole, split = updated_weights(cfg(6)), updated_weights(cfg(2))
    for a, b in zip(whole, split, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    before = [p.detach() for p in tiny_policy()[0].parameters()]
    assert any(not torch.equal(a, b) for a, b in zip(before, whole, strict=True))
