"""``sptool.models.decode_attention``: the grouped attention for one decoding position gives SDPA's
output (random grouped-query tensors with padding masked, and a real small Llama's greedy decoding
with left-padded prompts), and leaves every other query length to SDPA."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from sptool.models.decode_attention import (  # noqa: E402
    NAME, attention_implementation, grouped_decode_attention)


def sdpa(query, key, value, mask, scaling):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    module = torch.nn.Module()
    module.num_key_value_groups = query.shape[1] // key.shape[1]
    module.is_causal = True
    return sdpa_attention_forward(module, query, key, value, mask, scaling=scaling)[0]


@pytest.mark.parametrize("kv_heads", [1, 3, 9])
def test_one_position_equals_sdpa_with_padding_masked(kv_heads):
    generator = torch.Generator().manual_seed(kv_heads)
    batch, heads, positions, dim = 4, 9, 11, 16
    query = torch.randn(batch, heads, 1, dim, generator=generator)
    key = torch.randn(batch, kv_heads, positions, dim, generator=generator)
    value = torch.randn(batch, kv_heads, positions, dim, generator=generator)
    mask = torch.ones(batch, 1, 1, positions, dtype=torch.bool)
    mask[1, ..., :4] = False  # a left-padded row
    mask[3, ..., 7:] = False  # a static cache's unwritten tail
    module = torch.nn.Module()
    module.training = False
    ours, weights = grouped_decode_attention(module, query, key, value, mask, scaling=0.25)
    assert weights is None and ours.shape == (batch, 1, heads, dim)
    assert torch.allclose(ours, sdpa(query, key, value, mask, 0.25), atol=1e-5)
    # the masked positions do not count: changing them changes nothing
    value[1, :, :4] += 100.0
    value[3, :, 7:] -= 100.0
    again, _ = grouped_decode_attention(module, query, key, value, mask, scaling=0.25)
    assert torch.allclose(again, ours, atol=1e-5)


def test_longer_queries_go_to_sdpa():
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(2, 6, 5, 8, generator=generator)
    key = torch.randn(2, 2, 5, 8, generator=generator)
    value = torch.randn(2, 2, 5, 8, generator=generator)
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal, module.training = 3, True, False
    ours, _ = grouped_decode_attention(module, query, key, value, None, scaling=0.3)
    assert torch.equal(ours, sdpa(query, key, value, None, 0.3))


def test_a_small_llama_decodes_the_same_greedy_tokens():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=64,
                         pad_token_id=0, eos_token_id=1, bos_token_id=2)
    model = LlamaForCausalLM(config).eval()
    model.set_attn_implementation("sdpa")
    input_ids = torch.tensor([[0, 0, 0, 5, 9, 13], [3, 4, 8, 21, 34, 55]])  # the first row left padded
    attention_mask = (input_ids != 0).long()
    settings = dict(max_new_tokens=12, do_sample=False, pad_token_id=0, output_scores=True,
                    return_dict_in_generate=True)
    with torch.no_grad():
        reference = model.generate(input_ids=input_ids, attention_mask=attention_mask, **settings)
        with attention_implementation(model, "grouped"):
            assert model.config._attn_implementation == NAME
            grouped = model.generate(input_ids=input_ids, attention_mask=attention_mask, **settings)
    assert model.config._attn_implementation == "sdpa"  # restored
    assert torch.equal(grouped.sequences, reference.sequences)
    for ours, theirs in zip(grouped.scores, reference.scores):
        assert torch.allclose(ours, theirs, atol=1e-4)
