"""The warmup shape table: run the shapes serving will see before the first real request, so
that first-use costs (allocator growth, kernel selection, library initialisation, compiled
graphs where there are any) are not paid by a user."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from anna.core.sampling_params import SamplingParams, StructuredOutputsParams
from anna.runtime.engine import LLMEngine

log = logging.getLogger(__name__)

BASE_PREFILL_LENGTHS = (13, 64, 256, 2048)
BASE_BATCH_SIZES = (1, 2, 4, 8)
WARMUP_PROMPT_TOKENS = 8  # prompt length of the decode-batch shapes


@dataclass(frozen=True)
class WarmupTable:
    prefill_lengths: tuple[int, ...]
    batch_sizes: tuple[int, ...]
    decode_steps: int

    def describe(self) -> str:
        return (f"Warmup shape table: prefill_lengths={list(self.prefill_lengths)} "
                f"batch_sizes={list(self.batch_sizes)} decode_steps={self.decode_steps}")


def warmup_table(max_num_batched_tokens: int, chunk_size: int, max_num_seqs: int, max_model_len: int,
                 decode_steps: int, extra_prefill: int = 0, extra_batch: int = 0) -> WarmupTable:
    """Prefill lengths clipped to what one step can prefill (the token budget, the chunk size
    when others decode, the model length); batch sizes up to max_num_seqs; plus the extra shapes."""
    limit = min(max_num_batched_tokens, max_model_len - decode_steps)
    lengths = {min(n, limit) for n in BASE_PREFILL_LENGTHS} | {min(chunk_size, limit)}
    if extra_prefill:
        lengths.add(min(extra_prefill, limit))
    sizes = {b for b in BASE_BATCH_SIZES if b <= max_num_seqs}
    if extra_batch:
        sizes.add(min(extra_batch, max_num_seqs))
    return WarmupTable(tuple(sorted(x for x in lengths if x > 0)), tuple(sorted(sizes)), decode_steps)


def run_warmup(engine: LLMEngine) -> WarmupTable:
    """Run every shape of the table, then forget it: the prefix cache, the prompt cache and the
    statistics are as if nothing had run."""
    s = engine.settings
    table = warmup_table(s.max_num_batched_tokens, s.long_prefill_token_threshold, s.max_num_seqs,
                         engine.max_model_len, s.warmup_decode_steps, s.warmup_prefill_tokens, s.warmup_batch_size)
    log.info(table.describe())
    start = time.perf_counter()
    g = torch.Generator().manual_seed(0)
    vocab = min(engine.model_config.vocab_size, engine.tokenizer.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=max(1, table.decode_steps), ignore_eos=True)

    def prompt(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=g).tolist()

    shapes = [[n] for n in table.prefill_lengths] + [[WARMUP_PROMPT_TOKENS] * b for b in table.batch_sizes]
    for i, lengths in enumerate(shapes):
        for j, n in enumerate(lengths):
            engine.add_request(f"warmup-{i}-{j}", prompt(n), params)
        while engine.has_unfinished_requests():
            engine.step()
    # One constrained request: it builds the grammar engine's token trie (once per engine, ~0.4 s
    # at a 32k vocabulary), which the first user's constrained request would otherwise wait for.
    engine.add_request("warmup-structured", prompt(WARMUP_PROMPT_TOKENS), SamplingParams(
        temperature=0, max_tokens=max(1, table.decode_steps), structured_outputs=StructuredOutputsParams(json_object=True)))
    while engine.has_unfinished_requests():
        engine.step()
    shapes = engine.warm_up_decode_executor(list(table.batch_sizes))  # e.g. graphs for longer contexts
    if shapes:
        log.info("Decode graphs: %d shapes", shapes)
    engine.reset_after_warmup()
    log.info("Warmup took %.2f s", time.perf_counter() - start)
    return table
