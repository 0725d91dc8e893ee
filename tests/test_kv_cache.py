"""The in-place key/value cache decodes exactly as transformers' DynamicCache does."""

import pytest
import torch
from transformers import DynamicCache, Qwen2Config, Qwen2ForCausalLM

from mmrl.models.kv_cache import LONG_SEQUENCE, GrowingCache, decoding_cache


def tiny_lm(**overrides):
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=50,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=128,
        **overrides,
    )
    return Qwen2ForCausalLM(config).eval()


def greedy(model, cache, prompts, steps, drop_after=None):
    """Greedy tokens and every step's logits; after ``drop_after`` steps the last row leaves
    the batch (``batch_select_indices``), as a finished row leaves ``decode_rows``."""
    ids, tokens, logits = prompts, [], []
    with torch.no_grad():
        for step in range(steps):
            out = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1]
            logits.append(out)
            ids = out.argmax(-1, keepdim=True)
            tokens.append(ids)
            if step == drop_after:
                keep = torch.arange(len(ids) - 1)
                cache.batch_select_indices(keep)
                ids = ids[keep]
    return tokens, logits


@pytest.mark.parametrize("capacity", [3, 64])  # 3: the buffer grows (doubles) while decoding
def test_growing_cache_decodes_like_dynamic_cache(capacity):
    model = tiny_lm()
    prompts = torch.randint(0, 50, (3, 7))
    want = greedy(model, DynamicCache(config=model.config), prompts, 20, drop_after=5)
    cache = GrowingCache(model.config.num_hidden_layers, capacity)
    got = greedy(model, cache, prompts, 20, drop_after=5)
    assert all(torch.equal(a, b) for a, b in zip(want[0], got[0], strict=True))
    assert all(torch.equal(a, b) for a, b in zip(want[1], got[1], strict=True))
    assert cache.get_seq_length() == 7 + 19
    assert cache.layers[0].keys.shape == (2, 1, 26, 32)


def test_crop_and_repeat_keep_the_cache_consistent():
    model = tiny_lm()
    prompts = torch.randint(0, 50, (2, 6))
    dynamic, growing = DynamicCache(config=model.config), GrowingCache(2, 8)
    for cache in (dynamic, growing):
        with torch.no_grad():
            model(input_ids=prompts, past_key_values=cache, use_cache=True)
        cache.crop(-2)
        cache.batch_repeat_interleave(2)
    assert growing.get_seq_length() == dynamic.get_seq_length() == 4
    for a, b in zip(dynamic.layers, growing.layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_long_sequences_of_full_attention_models_get_the_growing_cache():
    full = tiny_lm()
    sliding = tiny_lm(use_sliding_window=True, sliding_window=4, max_window_layers=0)
    with decoding_cache(full, LONG_SEQUENCE) as cache:
        assert isinstance(cache, GrowingCache)
    for model, capacity in ((full, LONG_SEQUENCE - 1), (sliding, LONG_SEQUENCE)):
        with decoding_cache(model, capacity) as cache:
            assert not isinstance(cache, GrowingCache)


def test_bf16_decoding_attends_in_fp32_and_samples_what_sdpa_samples():
    """A bf16 model's cache holds fp32 on the CPU, and its one-query steps attend in fp32
    (mmrl.models.decode_attention): the logits agree with bf16 SDPA to bf16 rounding."""
    model = tiny_lm().to(torch.bfloat16)
    prompts = torch.randint(0, 50, (3, 7))
    want = greedy(model, DynamicCache(config=model.config), prompts, 12)
    with decoding_cache(model, LONG_SEQUENCE) as cache:
        assert model.config._attn_implementation != "sdpa"
        got = greedy(model, cache, prompts, 12)
    assert model.config._attn_implementation == "sdpa"  # restored
    assert cache.layers[0].keys.dtype == torch.float32
    assert all(torch.equal(a, b) for a, b in zip(want[0], got[0], strict=True))
    worst = max((a.float() - b.float()).abs().max() for a, b in zip(want[1], got[1], strict=True))
    assert worst < 0.05, worst  # bf16 logits of magnitude ~1 round at 2**-8
