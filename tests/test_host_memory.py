"""Host tensors on huge pages: the memory is right, lives as long as the tensor, moving a model's
weights there changes no value and moves a shared (tied) weight once, and an engine whose weights
and KV cache really are there still gives transformers' logits."""

import gc

import torch
from torch import nn

from anna.platforms.cpu.host_memory import HUGE_PAGE, huge_page_zeros, move_to_huge_pages
from anna.runtime.engine import LLMEngine
from conftest import COMMON, engine_settings, save_hf_model
from helpers import assert_logits_close, hf_greedy, hf_logits, run_logits


def test_huge_page_zeros_is_aligned_zeroed_and_outlives_its_mapping():
    t = huge_page_zeros((3, HUGE_PAGE // 4), torch.float32)  # 6 MB
    assert t.shape == (3, HUGE_PAGE // 4) and t.dtype == torch.float32 and t.is_contiguous()
    assert t.data_ptr() % HUGE_PAGE == 0
    assert not t.any()
    gc.collect()  # the mapping must stay alive through the tensor alone
    t[2, -1] = 7.0
    t[0, 0] = -1.0
    assert t.sum().item() == 6.0
    small = huge_page_zeros((16,), torch.bfloat16)  # under 2 MB: a plain tensor
    assert small.shape == (16,) and not small.any()


def test_move_to_huge_pages_keeps_values_and_ties():
    torch.manual_seed(0)
    model = nn.Module()
    model.big = nn.Linear(1024, 1024, bias=True)  # 4 MB weight, 4 KB bias
    model.head = nn.Linear(1024, 1024, bias=False)
    model.head.weight = model.big.weight  # tied, as an lm_head and its embedding
    model.register_buffer("table", torch.arange(HUGE_PAGE // 4, dtype=torch.int16))  # 1 MB: stays
    weight, bias, table = model.big.weight.detach().clone(), model.big.bias.detach().clone(), model.table.clone()
    bias_ptr, table_ptr = model.big.bias.data_ptr(), model.table.data_ptr()

    moved = move_to_huge_pages(model)

    assert moved == 1024 * 1024 * 4  # the tied weight once, nothing else
    assert model.big.weight.data_ptr() % HUGE_PAGE == 0
    assert model.head.weight is model.big.weight
    assert torch.equal(model.big.weight, weight) and torch.equal(model.big.bias, bias)
    assert model.big.bias.data_ptr() == bias_ptr and model.table.data_ptr() == table_ptr
    assert torch.equal(model.table, table)
    x = torch.randn(2, 1024)
    torch.testing.assert_close(model.head(x), x @ weight.t())


def test_engine_on_huge_pages_matches_transformers(tmp_path, cache_dir):
    """The test models elsewhere are too small for any tensor to reach 2 MB; this one's embedding
    (tied to the lm_head), attention and MLP weights and each layer's KV cache are larger."""
    import transformers

    config = transformers.Qwen2Config(**{**COMMON, "hidden_size": 768, "intermediate_size": 1024,
                                         "tie_word_embeddings": True})
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.04)
    path = save_hf_model(model, tmp_path / "qwen2-wide")
    engine = LLMEngine(engine_settings(path, cache_dir, cpu_huge_pages=True), show_progress=False)
    net = engine.runner.model
    for t in (net.lm_head.weight, net.layers[0].mlp.gate_up_proj.weight, engine.runner.kv_caches[1][0]):
        assert t.numel() * t.element_size() >= HUGE_PAGE and t.data_ptr() % HUGE_PAGE == 0
    prompt = [(i * 37 + 11) % 700 + 3 for i in range(40)]
    logits, tokens = run_logits(engine, prompt, 8)
    assert tokens == hf_greedy(model, prompt, 9)
    assert_logits_close(logits, hf_logits(model, prompt + tokens[:-1]))
