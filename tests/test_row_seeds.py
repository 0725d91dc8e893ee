"""A response depends on its row's seed alone, and an update's mini-batches on the batch alone,
so a run sampled and trained at any worker count takes the same steps (docs/operations.md)."""

from __future__ import annotations

import numpy as np
import torch

from mmrl.hybrid.minibatch import epoch_order, minibatch_layout
from mmrl.models import get_family
from mmrl.models.row_sampling import RowSeededSampler
from mmrl.processors import TextProcessor
from mmrl.protocol import Batch
from mmrl.rollout.module import ModuleRollout
from mmrl.sampling import SEEDS_KEY, SamplingParams, row_seeds
from tests.conftest import save_tiny_qwen2


def test_a_row_samples_the_same_response_in_any_split(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = save_tiny_qwen2(tmp_path / "lm", tied=False, seed=2)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    text = ["12+34=", "1+2=", "7=", "40+2=", "3+3=", "99+1="]
    prompts = TextProcessor(tokenizer, max_prompt_length=8).encode_prompts(text).repeat(2)
    prompts[SEEDS_KEY] = row_seeds(123, len(prompts))
    engine = ModuleRollout(model, get_family("text_lm"), tokenizer)
    sampling = SamplingParams(max_tokens=10, temperature=0.9, top_k=20, seed=5)

    whole = engine.generate(prompts, sampling)
    # Other rows beside it, another padding width, another global seed: the same response.
    parts = [engine.generate(prompts[rows], sampling) for rows in (np.arange(5), np.arange(5, 12))]
    split = Batch.concat(parts)
    assert torch.equal(split["responses"], whole["responses"])
    mask = whole["response_mask"].bool()
    assert (split["rollout_log_probs"] - whole["rollout_log_probs"]).abs()[mask].max() < 1e-5
    # The seeds, not the call, decide: other seeds sample other responses.
    prompts[SEEDS_KEY] = row_seeds(124, len(prompts))
    other = engine.generate(prompts, sampling)
    assert not torch.equal(other["responses"], whole["responses"])


def test_row_seeded_draws_follow_the_sampled_distribution():
    """Inverse-CDF draws land on each token with its probability (within 4 standard errors),
    never on a token of zero probability, and keep what they sampled from."""
    probs = torch.tensor([0.5, 0.0, 0.2, 0.25, 0.05])
    rows = 20_000
    scores = probs.log().expand(rows, -1)
    uniforms = torch.rand(rows, 1, generator=torch.Generator().manual_seed(0))
    sampler = RowSeededSampler(uniforms)
    chosen = sampler(torch.zeros(rows, 3, dtype=torch.long), scores)
    assert torch.isfinite(chosen).sum(-1).eq(1).all()  # one token per row survives
    counts = torch.bincount(chosen.argmax(-1), minlength=len(probs)).double()
    assert counts[1] == 0
    se = (probs * (1 - probs) / rows).sqrt().double()
    assert ((counts / rows - probs.double()).abs() <= 4 * se + 1e-12).all(), counts / rows
    assert torch.equal(sampler.scores[0], scores)


def test_row_seeds_are_distinct_across_rows_and_steps():
    seeds = torch.cat([row_seeds(1_000_003 * 0 + step, 64) for step in range(4)])
    assert len(set(seeds.tolist())) == len(seeds)
    assert torch.equal(row_seeds(7, 4, first_row=2), row_seeds(7, 6)[2:])


def test_each_rank_holds_its_part_of_every_global_mini_batch():
    rows, mini, seed = 48, 12, 3
    one = minibatch_layout(rows, mini, 1, seed)
    assert torch.equal(one, torch.from_numpy(np.random.default_rng(seed).permutation(rows)))
    for world in (2, 4):
        layout = minibatch_layout(rows, mini, world, seed).view(world, rows // world)
        for j in range(rows // mini):
            local = mini // world
            parts = [set(layout[r, j * local : (j + 1) * local].tolist()) for r in range(world)]
            assert set().union(*parts) == set(one[j * mini : (j + 1) * mini].tolist())


def test_later_epochs_regroup_rows_alike_at_any_worker_count():
    rows, mini, seed = 24, 8, 11
    one_worker = epoch_order(rows, mini, seed, epoch=1, rank=0)
    groups_one = {frozenset(one_worker[i : i + mini].tolist()) for i in range(0, rows, mini)}
    # Two ranks, rank r holding global columns [r * 4, r * 4 + 4) of each mini-batch.
    local = mini // 2
    global_of = [
        np.arange(rows).reshape(rows // mini, mini)[:, r * local : (r + 1) * local].reshape(-1)
        for r in range(2)
    ]
    regrouped = [
        global_of[r][epoch_order(rows // 2, local, seed, 1, rank=r).numpy()] for r in (0, 1)
    ]
    groups_two = {
        frozenset(regrouped[0][i : i + local].tolist() + regrouped[1][i : i + local].tolist())
        for i in range(0, rows // 2, local)
    }
    assert groups_two == groups_one
    # Rows meet new partners: the regrouping is not the identity.
    assert groups_one != {frozenset(range(i, i + mini)) for i in range(0, rows, mini)}
