"""One-query decoding attention in fp32 computes what transformers' SDPA path computes."""

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from mmrl.models.decode_attention import one_query_attention


class Heads(torch.nn.Module):
    num_key_value_groups = 2  # 4 query heads over 2 key/value heads
    is_causal = True


def test_one_query_attention_matches_sdpa_in_fp32_arithmetic():
    gen = torch.Generator().manual_seed(0)
    query = torch.randn(3, 4, 1, 16, generator=gen)
    key, value = (torch.randn(3, 2, 9, 16, generator=gen) for _ in range(2))
    mask = torch.ones(3, 1, 1, 9, dtype=torch.bool)
    mask[0, ..., :4] = False  # a left-padded row
    with torch.no_grad():
        for m in (mask, None):
            want, _ = sdpa_attention_forward(Heads(), query, key, value, m, scaling=0.25)
            # a bf16 query against the fp32 keys and values a GrowingCache holds
            got, _ = one_query_attention(Heads(), query.bfloat16(), key, value, m, scaling=0.25)
            assert got.dtype == torch.bfloat16 and got.shape == want.shape == (3, 1, 4, 16)
            assert (got.float() - want).abs().max() < 2e-2  # the query's and output's rounding
            exact, _ = one_query_attention(Heads(), query, key, value, m, scaling=0.25)
            torch.testing.assert_close(exact, want)  # fp32 queries take SDPA itself
