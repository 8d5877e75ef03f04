"""Host tensors on huge pages: the memory is right, lives as long as the tensor, and moving a
model's weights there changes no value and moves a shared (tied) weight once."""

import gc

import torch
from torch import nn

from anna.model.host_memory import HUGE_PAGE, huge_page_zeros, move_to_huge_pages


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
