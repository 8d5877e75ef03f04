"""Graph decode on CUDA: a decode-only step replays a captured forward pass instead of launching
its few hundred kernels one by one from Python.

A captured graph has fixed shapes and reads fixed addresses, so each step is copied into static
buffers and padded: the batch up to the next capture size (1, 2, 4, then multiples of 8, as
vLLM), the block tables up to the next power-of-two number of blocks (the decode attention reads
every position of its tables, masked; a table as long as max_model_len on every step would make
short sequences pay for the longest). One graph per (batch size, blocks) pair, all sharing one
memory pool: warmup captures every block count for its batch sizes, other shapes are captured
the first time a step needs them.

Padded rows decode token 0 at position 0 into a KV block that no request owns (the runner
allocates one block more than the KV cache manager hands out), attending to that one slot, so
they never touch a request's cache; their outputs are dropped. Padded table entries and
positions past a row's context are masked, as in an eager step.

Where there is no capture (``capture=False``: any device but CUDA), the padded step runs
eagerly: the same shapes and buffers, which is what the CPU tests check against the eager path.
If a capture fails (not the model: the step then runs eagerly and fails on its own if it must),
one warning says why and every later step runs eager.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from anna.model.attention import AttentionMetadata
from anna.runtime.compilation import first_line

log = logging.getLogger(__name__)


def batch_sizes(max_num_seqs: int) -> list[int]:
    """The batch sizes graphs are captured for: 1, 2, 4, 8, 16, 24, ... and max_num_seqs."""
    sizes = [n for n in (1, 2, 4) if n < max_num_seqs] + list(range(8, max_num_seqs, 8))
    return sizes + [max_num_seqs]


def padded_batch(n: int, sizes: list[int]) -> int:
    return next(size for size in sizes if size >= n)


def padded_blocks(n: int, max_blocks: int) -> int:
    """The next power of two >= n, at most max_blocks."""
    return min(1 << max(n - 1, 0).bit_length(), max_blocks)


class GraphDecoder:
    """Runs decode-only forward passes through captured graphs (see the module docstring)."""

    spare_blocks = 1  # padded rows write into one KV block that no request owns

    def __init__(self, forward: Callable[..., torch.Tensor], *, block_size: int, max_num_seqs: int,
                 max_model_len: int, device: torch.device, capture: bool) -> None:
        self.forward = forward
        self.kv_caches: list = []
        self.pad_block = -1
        self.block_size = block_size
        self.sizes = batch_sizes(max_num_seqs)
        self.max_blocks = -(-max_model_len // block_size)
        self.capture = capture
        rows, width = self.sizes[-1], self.max_blocks * block_size
        self.input_ids = torch.zeros(rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.slots = torch.zeros(rows, dtype=torch.long, device=device)
        self.tables = torch.zeros(rows, self.max_blocks, dtype=torch.long, device=device)
        self.context_lens = torch.ones(rows, dtype=torch.long, device=device)
        self.mask = torch.ones(rows, width, dtype=torch.bool, device=device)  # True = masked out
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.replays = 0  # decode steps served
        self.failed = False  # a capture failed: every step runs eager

    def attach(self, kv_caches: list, pad_block: int) -> None:
        """The runner's caches, whose block ``pad_block`` is the spare one."""
        self.kv_caches, self.pad_block = kv_caches, pad_block

    def applies(self, meta: AttentionMetadata, num_tokens: int, kv_caches: list) -> bool:
        return not self.failed and not meta.prefills and meta.num_decode_tokens == num_tokens <= self.sizes[-1]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list,
            meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [n, hidden] of a decode-only step, as the eager forward returns them."""
        try:
            return self._run(input_ids, positions, meta)
        except Exception as exc:  # capture (not the model) failed: this step and the rest run eager
            log.warning("decode_executor=graph: capture failed, running eager from now on: %s", first_line(exc))
            self.failed = True
            return self.forward(input_ids, positions, kv_caches, meta)

    def _run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        n = input_ids.shape[0]
        rows = padded_batch(n, self.sizes)
        used = meta.decode_block_tables.shape[1]
        blocks = padded_blocks(used, self.max_blocks)
        bs = self.block_size
        self.input_ids[:n] = input_ids
        self.positions[:n] = positions
        self.slots[:n] = meta.slot_mapping
        self.tables[:n, :used] = meta.decode_block_tables
        self.tables[:n, used:blocks] = self.pad_block
        self.context_lens[:n] = meta.decode_context_lens
        self.mask[:n, :used * bs] = meta.decode_mask
        self.mask[:n, used * bs:blocks * bs] = True
        self._pad_rows(n, rows, blocks)
        out = self._replay(rows, blocks)
        self.replays += 1
        return out[:n]

    def warm_up(self, batch_sizes: list[int]) -> int:
        """Capture, for these batch sizes, every block count a step can pad to, with padded rows
        only (they write nothing but the spare block), so that no request waits for a capture.
        Returns the number of shapes run."""
        block_counts = sorted({padded_blocks(1 << i, self.max_blocks) for i in range(self.max_blocks.bit_length() + 1)})
        shapes = [(rows, blocks) for rows in sorted({padded_batch(b, self.sizes) for b in batch_sizes})
                  for blocks in block_counts]
        for rows, blocks in shapes:
            self._pad_rows(0, rows, blocks)
            self._replay(rows, blocks)
        return len(shapes)

    def _pad_rows(self, n: int, rows: int, blocks: int) -> None:
        """Rows n..rows: token 0 at position 0, into (and attending to) the spare block's first slot."""
        if rows > n:
            self.input_ids[n:rows] = 0
            self.positions[n:rows] = 0
            self.slots[n:rows] = self.pad_block * self.block_size
            self.tables[n:rows, :blocks] = self.pad_block
            self.context_lens[n:rows] = 1
            self.mask[n:rows, :blocks * self.block_size] = True
            self.mask[n:rows, 0] = False

    def _replay(self, rows: int, blocks: int) -> torch.Tensor:
        """Run the shape on what the buffers hold: replay its graph (captured now if new), or,
        without capture, the forward pass on the buffers."""
        if not self.capture:
            return self.forward(*self._static_inputs(rows, blocks))
        key = (rows, blocks)
        if key not in self.graphs:
            self.graphs[key] = self._capture(rows, blocks)
        graph, out = self.graphs[key]
        graph.replay()
        return out

    def _static_inputs(self, rows: int, blocks: int) -> tuple:
        meta = AttentionMetadata(
            slot_mapping=self.slots[:rows], num_decode_tokens=rows, decode_block_tables=self.tables[:rows, :blocks],
            decode_context_lens=self.context_lens[:rows], decode_mask=self.mask[:rows, :blocks * self.block_size],
            prefills=[], block_size=self.block_size)
        return self.input_ids[:rows], self.positions[:rows], self.kv_caches, meta

    def _capture(self, rows: int, blocks: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Capture one shape. The buffers hold the current step, so the warm-up pass (which lets
        lazy initialisation happen outside the capture) writes the same KV the replay writes."""
        inputs = self._static_inputs(rows, blocks)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.forward(*inputs)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self.forward(*inputs)
        log.info("Captured a decode graph: batch %d, %d KV blocks (%d graphs)", rows, blocks, len(self.graphs) + 1)
        return graph, out
