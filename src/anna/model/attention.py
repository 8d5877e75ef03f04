"""Attention over a paged KV cache.

The cache of one layer is two tensors ``[num_blocks, num_kv_heads, block_size, row]`` (``PagedKV``,
rows stored as its format says: model/kv_format.py): within
a block, each KV head's rows are contiguous, so decode attention (one job per sequence and KV
head) streams them instead of reading every other row (1.5x faster at 1,024 tokens, memory-bound).
A sequence's tokens live in the blocks its block table lists, in order; a token's "slot" is
block * block_size + its offset in the block. The batch handed to a
forward pass puts decode sequences (one new token each) first, then prefill chunks; decodes
are computed together in one batched gather, prefill chunks one sequence at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from anna.model.kv_format import KVFormat
from anna.model.ops import ModelOps


class PagedKV(tuple):
    """One paged attention layer's cache: the (K, V) tensors, and the format their rows are
    stored in. Unpacks as the pair; copies of rows (prefix blocks, the exact prompt cache) move
    stored rows as they are."""

    format: KVFormat

    def __new__(cls, k: torch.Tensor, v: torch.Tensor, fmt: KVFormat) -> "PagedKV":
        self = super().__new__(cls, (k, v))
        self.format = fmt
        return self


@dataclass
class PrefillChunk:
    query_start: int  # index of the chunk's first token in the flattened batch
    query_len: int
    context_len: int  # tokens of the sequence after this chunk (cached prefix + chunk)
    block_table: torch.Tensor  # [num_blocks] long, on the device
    mask: torch.Tensor | None  # [query_len, context_len] bool, True = attend; None = plain causal over the chunk


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] long: cache slot (block * block_size + offset) of each new token
    num_decode_tokens: int  # the first tokens of the batch are single-token decodes
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks] long
    decode_context_lens: torch.Tensor | None  # [num_decodes] long, the new token included
    decode_mask: torch.Tensor | None  # [num_decodes, padded context] bool, True = masked out
    prefills: list[PrefillChunk]
    block_size: int
    state_slots: torch.Tensor | None = None  # [num_seqs] long, model order: each sequence's state slot (StateSpec layers)
    # StateSpec layers: [num_decodes] long, where each decode row's state comes from when that is not
    # its own slot (speculative decoding verifies a sequence's proposals as rows that chain their
    # states, each token's kept in a slot of its own); None: every row continues its own slot
    state_src_slots: torch.Tensor | None = None


def token_slots(starts: list[int], lens: list[int], tables: list[list[int]],
                block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For sequences that add ``lens`` tokens after ``starts`` computed ones, with these block
    tables: every new token's position, the padded tables [B, max_blocks] and every new token's
    cache slot (all on the host)."""
    positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lens)])
    width = max(len(t) for t in tables)
    table_tensor = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
    owner = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    return positions, table_tensor, table_tensor[owner, positions // block_size] * block_size + positions % block_size


def build_metadata(slot_mapping: torch.Tensor, starts: list[int], lens: list[int], tables: torch.Tensor,
                   block_size: int, sliding_window: int | None, device: torch.device) -> AttentionMetadata:
    """Metadata for a batch whose sequences are ordered decodes first. ``starts``: computed tokens
    before this step; ``lens``: new tokens; ``tables``: padded block tables [B, max_blocks] (host).
    Masks are built here once per step, not in every layer."""
    num_decodes = sum(1 for n in lens if n == 1)
    tables_dev = tables.to(device)
    prefills = []
    offset = num_decodes
    for j in range(num_decodes, len(lens)):
        qlen, ctx = lens[j], starts[j] + lens[j]
        mask = None
        if ctx != qlen or (sliding_window is not None and ctx > sliding_window):
            qpos = torch.arange(ctx - qlen, ctx, device=device).unsqueeze(1)
            kpos = torch.arange(ctx, device=device).unsqueeze(0)
            mask = kpos <= qpos
            if sliding_window is not None:
                mask &= kpos > qpos - sliding_window
        prefills.append(PrefillChunk(offset, qlen, ctx, tables_dev[j], mask))
        offset += qlen
    decode_tables = decode_mask = decode_lens = None
    if num_decodes:
        ctx_list = [s + 1 for s in starts[:num_decodes]]
        max_ctx = max(ctx_list)
        num_blocks = -(-max_ctx // block_size)
        decode_tables = tables_dev[:num_decodes, :num_blocks]
        decode_ctx = torch.tensor(ctx_list, dtype=torch.long).unsqueeze(1)
        pos = torch.arange(num_blocks * block_size).unsqueeze(0)
        masked = pos >= decode_ctx
        if sliding_window is not None:
            masked |= pos < decode_ctx - sliding_window
        decode_mask = masked.to(device)
        decode_lens = decode_ctx.view(-1).to(device)
    return AttentionMetadata(slot_mapping=slot_mapping.to(device), num_decode_tokens=num_decodes,
                             decode_block_tables=decode_tables, decode_context_lens=decode_lens,
                             decode_mask=decode_mask, prefills=prefills,
                             block_size=block_size)


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, row_width: int) -> tuple[int, ...]:
    return (num_blocks, num_kv_heads, block_size, row_width)


def write_slots(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """cache at ``slots`` = stored rows [len(slots), num_kv_heads, row]."""
    block_size = cache.shape[2]
    cache[slots // block_size, :, slots % block_size] = rows.to(cache.dtype)


def read_slots(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The stored rows at ``slots``: [len(slots), num_kv_heads, row] (a copy)."""
    block_size = cache.shape[2]
    return cache[slots // block_size, :, slots % block_size]


def gather_blocks(cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """The rows of the blocks ``tables`` lists, in order: [*tables.shape[:-1], blocks * block_size,
    num_kv_heads, row] (a copy)."""
    rows = cache[tables].transpose(-3, -2)  # [..., blocks, block_size, kv_heads, row]
    return rows.reshape(*tables.shape[:-1], -1, *rows.shape[-2:])


def write_kv(cache: PagedKV, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """The new tokens' k, v [T, KV, D] into their slots, in the cache's format."""
    fmt = cache.format
    write_slots(cache[0], slot_mapping, fmt.encode(k))
    write_slots(cache[1], slot_mapping, fmt.encode(v))


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: PagedKV, meta: AttentionMetadata,
                    scale: float, sliding_window: int | None, ops: ModelOps) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, KV, D] for the new tokens. Writes k/v to the cache, returns [T, H, D].
    (The sliding window is already in the masks; ``sliding_window`` is for Anna's CPU kernel.)"""
    ops.write_kv(cache, k, v, meta.slot_mapping)
    nd = meta.num_decode_tokens

    def prefill(chunk: PrefillChunk) -> torch.Tensor:
        sl = slice(chunk.query_start, chunk.query_start + chunk.query_len)
        if chunk.mask is None and cache.format.stores_exactly(k.dtype):  # a whole prompt over itself
            keys, values = k[sl], v[sl]
        else:  # the chunk's context as the cache holds it
            keys, values = _cached_context(cache, chunk, meta.block_size, q.dtype)
        return ops.causal_attention(q[sl], keys, values, scale, chunk.mask, sliding_window)

    if not nd and len(meta.prefills) == 1 and meta.prefills[0].query_len == q.shape[0]:
        return prefill(meta.prefills[0]).contiguous()  # a lone prompt chunk: no copy where it is contiguous
    out = torch.empty_like(q)
    if nd:
        out[:nd] = ops.decode_attention(q[:nd], cache, meta, scale, sliding_window)
    for chunk in meta.prefills:
        out[chunk.query_start:chunk.query_start + chunk.query_len] = prefill(chunk)
    return out


def torch_decode_attention(q: torch.Tensor, cache: PagedKV, meta: AttentionMetadata, scale: float,
                           dtype: torch.dtype) -> torch.Tensor:
    """Decode attention in torch: one batched gather of every sequence's blocks, decoded, masked."""
    nd, num_heads, head_dim = q.shape
    k_cache, v_cache = cache
    num_kv = k_cache.shape[1]
    tables = meta.decode_block_tables
    keys = cache.format.decode(gather_blocks(k_cache, tables), dtype)
    # Padding slots may hold never-written memory (NaN/inf): zero them so that 0 * garbage stays 0.
    values = cache.format.decode(gather_blocks(v_cache, tables), dtype)
    values = values.masked_fill(meta.decode_mask[:, :, None, None], 0.0)
    qg = q.view(nd, num_kv, num_heads // num_kv, head_dim).to(dtype)
    scores = torch.einsum("bkgd,blkd->bkgl", qg, keys) * scale
    scores.masked_fill_(meta.decode_mask[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bkgl,blkd->bkgd", probs, values)
    return out.reshape(nd, num_heads, head_dim).to(q.dtype)


def _cached_context(cache: PagedKV, chunk: PrefillChunk, block_size: int,
                    dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A prefill chunk's context as the cache holds it, keys and values [context_len, KV, D]: a
    cached prefix, or, in a format that does not keep rows exactly, the chunk's own rows read back
    too, so that a prompt attends to the same values however it was split into chunks or found
    cached."""
    table = chunk.block_table[:-(-chunk.context_len // block_size)]
    return tuple(cache.format.decode(gather_blocks(c, table)[:chunk.context_len], dtype) for c in cache)


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None,
                   dtype: torch.dtype) -> torch.Tensor:
    """torch's SDPA in ``dtype`` on Anna's layout: q [Tq, H, D], k, v [Tk, KV, D] -> [Tq, H, D] in
    q's dtype; ``mask`` [Tq, Tk] (True: attend), or None for causal attention with Tq = Tk."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0).to(dtype), k.transpose(0, 1).unsqueeze(0).to(dtype),
        v.transpose(0, 1).unsqueeze(0).to(dtype), attn_mask=mask, is_causal=mask is None, scale=scale,
        enable_gqa=True)
    return out.squeeze(0).transpose(0, 1).to(q.dtype)
