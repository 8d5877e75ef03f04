"""Prompt logprobs (SamplingParams.prompt_logprobs; echo + logprobs over HTTP) against
transformers: whole or chunked prefill, batched, after a prefix-cache hit would have applied,
and with n > 1."""

from __future__ import annotations

import pytest
import torch

from anna import LLM, SamplingParams
from helpers import hf_logits, record_batches

PROMPT = [(i * 37 + 11) % 700 + 3 for i in range(40)]
OTHER = [(i * 53 + 7) % 700 + 3 for i in range(25)]


@pytest.fixture(scope="module")
def llm(qwen2_dir, cache_dir):
    # a token budget of 16 splits the 40-token prompt into 3 prefill chunks
    return LLM(str(qwen2_dir), dtype="float32", device="cpu", cache_dir=str(cache_dir), max_model_len=512,
               num_gpu_blocks_override=128, max_num_batched_tokens=16, block_size=8)


def assert_prompt_logprobs_match(out, prompt, ref_logits, k):
    lps = out.prompt_logprobs
    assert len(lps) == len(prompt) and lps[0] is None
    ref = torch.log_softmax(ref_logits, dim=-1)
    for pos in range(1, len(prompt)):
        entry, row = lps[pos], ref[pos - 1]
        assert abs(entry[prompt[pos]].logprob - row[prompt[pos]].item()) < 1e-4, pos
        ranked = sorted((lp.rank, tid) for tid, lp in entry.items() if lp.rank <= k)
        assert [tid for _, tid in ranked] == torch.topk(row, k).indices.tolist(), pos
        assert entry[prompt[pos]].rank == int((row > row[prompt[pos]]).sum()) + 1, pos  # in the top k or not


def test_prompt_logprobs_match_transformers_across_chunks(llm, hf_models):
    model = hf_models["qwen2"][0]
    steps = record_batches(llm.llm_engine)
    out = llm.generate([PROMPT], SamplingParams(max_tokens=2, prompt_logprobs=3, temperature=0), use_tqdm=False)[0]
    assert [s for s in steps if s[0] > 1][:3] == [[16], [16], [8]]  # chunked as intended
    assert_prompt_logprobs_match(out, PROMPT, hf_logits(model, PROMPT), 3)


def test_prompt_logprobs_in_a_batch_after_the_prefix_is_cached_and_with_n(llm, hf_models):
    model = hf_models["qwen2"][0]
    llm.generate([PROMPT], SamplingParams(max_tokens=1), use_tqdm=False)  # its blocks are now cached
    outs = llm.generate([PROMPT, OTHER], [SamplingParams(max_tokens=3, prompt_logprobs=0, n=2, temperature=0.8),
                                          SamplingParams(max_tokens=3, prompt_logprobs=2)], use_tqdm=False)
    assert outs[0].num_cached_tokens == 0  # every position computed, not taken from the cache
    assert_prompt_logprobs_match(outs[0], PROMPT, hf_logits(model, PROMPT), 0)
    assert_prompt_logprobs_match(outs[1], OTHER, hf_logits(model, OTHER), 2)
    assert len(outs[0].outputs) == 2
    plain = llm.generate([PROMPT], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert plain.prompt_logprobs is None and plain.num_cached_tokens > 0
    engine = llm.llm_engine
    assert engine.kv.num_free_blocks == engine.kv.num_blocks and not engine.has_unfinished_requests()


def test_prompt_logprobs_is_validated():
    with pytest.raises(ValueError, match="^prompt_logprobs: must be an integer in"):
        SamplingParams(prompt_logprobs=21)


def test_prompt_logprobs_survive_preemption(qwen2_dir, cache_dir, hf_models):
    """Four 70-token sequences in a 96-token pool: some are preempted and recomputed, and their
    prompt logprobs are written again at the same positions, not appended."""
    llm = LLM(str(qwen2_dir), dtype="float32", device="cpu", cache_dir=str(cache_dir), max_model_len=96,
              num_gpu_blocks_override=12, block_size=8, max_num_batched_tokens=32)
    prompts = [[(i * 7 + j * 13) % 700 + 3 for i in range(30)] for j in range(4)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=40, ignore_eos=True, prompt_logprobs=1, temperature=0),
                        use_tqdm=False)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outs):
        assert_prompt_logprobs_match(out, prompt, hf_logits(hf_models["qwen2"][0], prompt), 1)
    assert llm.llm_engine.kv.num_free_blocks == llm.llm_engine.kv.num_blocks
