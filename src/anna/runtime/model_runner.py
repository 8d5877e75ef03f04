"""Builds input tensors from a scheduled batch, runs the model, samples.

The runner owns the KV cache tensors and the model; it never decides who runs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from anna.core.errors import RequestError
from anna.core.request import Request
from anna.model.attention import AttentionMetadata, build_metadata, kv_cache_shape, read_slots, write_slots
from anna.model.host_memory import huge_page_zeros
from anna.model.linear import profiled
from anna.model.llama import LlamaForCausalLM
from anna.runtime.compilation import CompiledForward, first_line
from anna.runtime.cuda_graphs import GraphDecoder
from anna.runtime.kv_cache import KVCacheManager
from anna.runtime.sampler import SampleResult, Sampler, token_logprobs
from anna.runtime.scheduler import ScheduledBatch

log = logging.getLogger(__name__)


@dataclass
class SampledToken:
    value: int | None  # on the host; None while it stays on the device (the request's sync window)
    logprobs: tuple | None
    ref: tuple[torch.Tensor, int]  # (the step's sampled tokens on the device, row)


@dataclass
class StepResult:
    sampled: dict[str, SampledToken]  # by request id: the requests that got a new token
    # by request id: (first prompt position, [(logprob, top alternatives), ...]) for requests with
    # prompt_logprobs whose prefill chunk ran in this step
    prompt_logprobs: dict[str, tuple[int, list[tuple[float, list[tuple[int, float]]]]]]
    # by request id: the requests this step could not serve (their input, or an error of theirs
    # alone); they got no token and are to be failed, the others go on
    failed: dict[str, RequestError] = field(default_factory=dict)


PROMPT_LOGPROBS_ROWS = 256  # prompt positions per lm_head call: bounds the [rows, vocab] logits


@dataclass
class ModelInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    order: list[int]  # batch index of each request in model order (decodes first)
    logits_indices: list[int]  # flattened-token index of the last token of each request, model order


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv: KVCacheManager, device: torch.device, kv_dtype: torch.dtype,
                 sampler: Sampler, compile_mode: str = "none", compile_fullgraph: bool = False,
                 graph_decode: bool = False, max_num_seqs: int = 1, max_model_len: int = 1,
                 huge_pages: bool = False) -> None:
        """``graph_decode``: decode-only steps go through a GraphDecoder (captured CUDA graphs on
        CUDA; elsewhere its padded shapes run eagerly), which needs one spare KV block.
        ``huge_pages``: on CPU, the KV cache lives on transparent huge pages (host_memory.py)."""
        self.model = model
        self.model_forward = model.forward if compile_mode == "none" else \
            CompiledForward(model.forward, compile_mode, compile_fullgraph)
        self.kv = kv
        self.device = device
        self.sampler = sampler
        cfg = model.config
        blocks = kv.num_blocks + (1 if graph_decode else 0)
        shape = kv_cache_shape(blocks, kv.block_size, cfg.num_key_value_heads, cfg.head_dim)
        # On CPU untouched pages cost no RAM until a block is first written (torch.empty or mmap).
        def new_cache() -> torch.Tensor:
            if huge_pages and device.type == "cpu":
                return huge_page_zeros(shape, kv_dtype)
            return torch.empty(shape, dtype=kv_dtype, device=device)

        self.kv_caches = [(new_cache(), new_cache()) for _ in range(cfg.num_hidden_layers)]
        self.graphs = GraphDecoder(model.forward, self.kv_caches, pad_block=kv.num_blocks, block_size=kv.block_size,
                                   max_num_seqs=max_num_seqs, max_model_len=max_model_len, device=device,
                                   capture=device.type == "cuda") if graph_decode else None

    def prepare(self, requests: list[Request], num_new_tokens: list[int]) -> ModelInputs:
        bs = self.kv.block_size
        order = sorted(range(len(requests)), key=lambda i: num_new_tokens[i] != 1)  # decodes first, stable
        ids: list[int] = []
        starts: list[int] = []
        lens: list[int] = []
        tables: list[list[int]] = []
        on_device: list[tuple[int, tuple[torch.Tensor, int]]] = []  # (flat index, pending token)
        for i in order:
            req, n = requests[i], num_new_tokens[i]
            start = req.num_computed_tokens
            if req.pending:  # tokens not yet read back: take them from where they were sampled
                first = req.num_tokens - len(req.pending)
                on_device.extend((len(ids) + pos - start, req.pending[pos - first])
                                 for pos in range(max(start, first), start + n))
            ids.extend(req.all_token_ids[start:start + n])
            starts.append(start)
            lens.append(n)
            tables.append(self.kv.block_ids(req.request_id))
        dev = self.device
        positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lens)])
        max_blocks = max(len(t) for t in tables)
        table_tensor = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.long)
        owner = torch.repeat_interleave(torch.arange(len(order)), torch.tensor(lens))
        slots = table_tensor[owner, positions // bs] * bs + positions % bs
        meta = build_metadata(slots, starts, lens, table_tensor, bs, self.model.config.sliding_window, dev)
        logits_indices = (torch.tensor(lens).cumsum(0) - 1).tolist()
        input_ids = torch.tensor(ids, dtype=torch.long, device=dev)
        if on_device:
            where = torch.tensor([flat for flat, _ in on_device], device=dev)
            input_ids[where] = torch.stack([t[row] for _, (t, row) in on_device])
        return ModelInputs(input_ids, positions.to(dev), meta, order, logits_indices)

    @torch.inference_mode()
    def forward(self, inputs: ModelInputs) -> torch.Tensor:
        """Hidden states of every scheduled token, in model order."""
        if self.graphs is not None and self.graphs.applies(inputs.meta, inputs.input_ids.shape[0]):
            try:
                return self.graphs.run(inputs.input_ids, inputs.positions, inputs.meta)
            except Exception as exc:  # capture (not the model) failed: this step and the rest run eager
                log.warning("decode_executor=graph: capture failed, running eager from now on: %s",
                            first_line(exc))
                self.graphs = None
        return self.model_forward(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)

    def _slots(self, request_id: str, num_tokens: int) -> torch.Tensor:
        bs = self.kv.block_size
        table = torch.tensor(self.kv.block_ids(request_id), dtype=torch.long)
        pos = torch.arange(num_tokens)
        return (table[pos // bs] * bs + pos % bs).to(self.device)

    @torch.inference_mode()
    def read_prompt_kv(self, req: Request) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copies of the KV of all prompt tokens but the last, for the exact prompt cache."""
        slots = self._slots(req.request_id, req.num_prompt_tokens - 1)
        return [(read_slots(k, slots), read_slots(v, slots)) for k, v in self.kv_caches]

    @torch.inference_mode()
    def write_prompt_kv(self, req: Request, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        slots = self._slots(req.request_id, kv[0][0].shape[0])
        for (k_cache, v_cache), (k, v) in zip(self.kv_caches, kv):
            write_slots(k_cache, slots, k)
            write_slots(v_cache, slots, v)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> StepResult:
        """Run one step; return the sampled token (and logprobs) of each request that finished
        its scheduled tokens with nothing left to compute (prefill done or a decode), and the
        prompt logprobs of the prefill chunks that asked for them. Tokens are read back to the
        host only if some request needs its token now."""
        for req, entry in batch.restores:
            self.write_prompt_kv(req, entry.kv)
        inputs = self.prepare(batch.requests, batch.num_new_tokens)
        hidden = self.forward(inputs)
        failed: dict[str, RequestError] = {}
        sampled = self._sample(batch, inputs, hidden, failed)
        return StepResult(sampled, self._prompt_logprobs(batch, inputs, hidden, failed), failed)

    def check_device(self) -> None:
        """Raise if the device can no longer run anything (after a failed step)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elif self.device.type == "xpu":
            torch.xpu.synchronize(self.device)

    def _prompt_logprobs(self, batch: ScheduledBatch, inputs: ModelInputs, hidden: torch.Tensor,
                         failed: dict[str, RequestError]) -> dict[str, tuple[int, list]]:
        """For requests with prompt_logprobs: the logprob of each prompt token that this step's
        chunk predicts (the hidden state at position p predicts the token at p + 1)."""
        out = {}
        for pos, i in enumerate(inputs.order):
            req, n = batch.requests[i], batch.num_new_tokens[i]
            k = req.sampling_params.prompt_logprobs
            start = req.num_computed_tokens
            end = min(start + n, req.num_prompt_tokens - 1)
            if k is None or end <= start or req.request_id in failed:
                continue
            first_row = inputs.logits_indices[pos] - n + 1
            entries = []
            try:
                for a in range(start, end, PROMPT_LOGPROBS_ROWS):
                    b = min(a + PROMPT_LOGPROBS_ROWS, end)
                    logits = self.model.compute_logits(hidden[first_row + a - start:first_row + b - start])
                    entries += token_logprobs(logits, req.all_token_ids[a + 1:b + 1], [k] * (b - a))
            except Exception as exc:  # this request's alone: the others keep theirs
                log.exception("prompt logprobs failed for request %s", req.request_id)
                failed[req.request_id] = RequestError.internal(exc)
                continue
            out[req.request_id] = (start + 1, entries)
        return out

    def _sample(self, batch: ScheduledBatch, inputs: ModelInputs, hidden: torch.Tensor,
                failed: dict[str, RequestError]) -> dict[str, SampledToken]:
        sampling = [(pos, batch.requests[i]) for pos, i in enumerate(inputs.order)
                    if batch.requests[i].num_computed_tokens + batch.num_new_tokens[i]
                    == batch.requests[i].num_tokens]
        if not sampling:
            return {}
        rows = torch.tensor([inputs.logits_indices[pos] for pos, _ in sampling], device=self.device)
        logits = self.model.compute_logits(hidden[rows])
        reqs = [r for _, r in sampling]
        with profiled(self.model.lm_head.policy, "sampling"):
            result: SampleResult = self.sampler(logits, reqs)
        for i, error in result.failed.items():
            failed[reqs[i].request_id] = error
        host = result.tokens.tolist() if any(r.sync_every == 1 for r in reqs) else None
        return {r.request_id: SampledToken(host[i] if host is not None and r.sync_every == 1 else None,
                                           result.logprobs[i], (result.tokens, i))
                for i, r in enumerate(reqs) if i not in result.failed}
