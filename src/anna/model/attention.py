"""Attention over a paged KV cache.

The cache of one layer is two tensors ``[num_blocks, block_size, num_kv_heads, head_dim]``.
A sequence's tokens live in the blocks its block table lists, in order. The batch handed to a
forward pass puts decode sequences (one new token each) first, then prefill chunks; decodes
are computed together in one batched gather, prefill chunks one sequence at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    query_start: int  # index of the chunk's first token in the flattened batch
    query_len: int
    context_len: int  # tokens of the sequence after this chunk (cached prefix + chunk)
    block_table: torch.Tensor  # [num_blocks] long, on the device


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] long: cache slot (block * block_size + offset) of each new token
    num_decode_tokens: int  # the first tokens of the batch are single-token decodes
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks] long
    decode_context_lens: torch.Tensor | None  # [num_decodes] long
    decode_max_context_len: int
    prefills: list[PrefillChunk]
    block_size: int


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                    sliding_window: int | None) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, KV, D] for the new tokens. Writes k/v to the cache, returns [T, H, D]."""
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    # Half-precision batched matmuls are slow on CPUs without native support: compute in fp32 there.
    compute_dtype = torch.float32 if q.device.type == "cpu" else q.dtype
    out = torch.empty_like(q)
    nd = meta.num_decode_tokens
    if nd:
        out[:nd] = _decode_attention(q[:nd], k_cache, v_cache, meta, scale, sliding_window, compute_dtype)
    for chunk in meta.prefills:
        sl = slice(chunk.query_start, chunk.query_start + chunk.query_len)
        out[sl] = _prefill_attention(q[sl], k[sl], v[sl], k_cache, v_cache, chunk, meta.block_size, scale,
                                     sliding_window, compute_dtype)
    return out


def _decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                      scale: float, sliding_window: int | None, dtype: torch.dtype) -> torch.Tensor:
    nd, num_heads, head_dim = q.shape
    num_kv = k_cache.shape[2]
    num_blocks = -(-meta.decode_max_context_len // meta.block_size)
    tables = meta.decode_block_tables[:, :num_blocks]
    length = num_blocks * meta.block_size
    keys = k_cache[tables].view(nd, length, num_kv, head_dim).to(dtype)
    values = v_cache[tables].view(nd, length, num_kv, head_dim).to(dtype)
    qg = q.view(nd, num_kv, num_heads // num_kv, head_dim).to(dtype)
    scores = torch.einsum("bkgd,blkd->bkgl", qg, keys) * scale
    pos = torch.arange(length, device=q.device)
    ctx = meta.decode_context_lens.unsqueeze(1)
    masked = pos.unsqueeze(0) >= ctx
    if sliding_window is not None:
        masked |= pos.unsqueeze(0) < ctx - sliding_window
    scores.masked_fill_(masked[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bkgl,blkd->bkgd", probs, values)
    return out.reshape(nd, num_heads, head_dim).to(q.dtype)


def _prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, chunk: PrefillChunk, block_size: int, scale: float,
                       sliding_window: int | None, dtype: torch.dtype) -> torch.Tensor:
    qlen, ctx = chunk.query_len, chunk.context_len
    if ctx == qlen and (sliding_window is None or ctx <= sliding_window):
        keys, values, mask, causal = k, v, None, True  # no cached prefix: plain causal attention
    else:
        num_blocks = -(-ctx // block_size)
        table = chunk.block_table[:num_blocks]
        keys = k_cache[table].flatten(0, 1)[:ctx]
        values = v_cache[table].flatten(0, 1)[:ctx]
        qpos = torch.arange(ctx - qlen, ctx, device=q.device).unsqueeze(1)
        kpos = torch.arange(ctx, device=q.device).unsqueeze(0)
        mask = kpos <= qpos
        if sliding_window is not None:
            mask &= kpos > qpos - sliding_window
        causal = False
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0).to(dtype), keys.transpose(0, 1).unsqueeze(0).to(dtype),
        values.transpose(0, 1).unsqueeze(0).to(dtype), attn_mask=mask, is_causal=causal, scale=scale,
        enable_gqa=True)
    return out.squeeze(0).transpose(0, 1).to(q.dtype)
