"""Builds input tensors from a scheduled batch, runs the model, samples.

The runner owns the cache tensors (allocated from the model's cache specs) and the model; it
never decides who runs. Decode-only steps go through the platform's decode executor where there
is one (CPU: the fused C decode stack; CUDA: captured graphs); everything else runs the model's
forward, eager or compiled.
"""

from __future__ import annotations

import dataclasses
import logging
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from anna.core.errors import RequestError
from anna.core.request import Request
from anna.model.attention import (AttentionMetadata, PagedKV, build_metadata, kv_cache_shape, read_slots, token_slots,
                                  write_slots)
from anna.model.cache_spec import AttentionSpec, CacheSpec, StateSpec
from anna.platforms import Platform
from anna.runtime.cache_managers import CacheManagers
from anna.runtime.compilation import CompiledForward
from anna.runtime.sampler import SampleResult, Sampler, token_logprobs
from anna.runtime.scheduler import ScheduledBatch
from anna.runtime.speculative.decoder import SpeculativeDecoder
from anna.runtime.speculative.verify import verify

log = logging.getLogger(__name__)


@dataclass
class SampledToken:
    value: int | None  # on the host; None while it stays on the device (the request's sync window)
    logprobs: tuple | None
    ref: tuple[torch.Tensor, int] | None  # (the step's sampled tokens on the device, row)
    accepted: list[int] = field(default_factory=list)  # proposed tokens accepted before ``value``
    accepted_logprobs: list[tuple | None] = field(default_factory=list)


@dataclass
class StepResult:
    sampled: dict[str, SampledToken]  # by request id: the requests that got a new token
    # by request id: (first prompt position, [(logprob, top alternatives, rank), ...]) for requests with
    # prompt_logprobs whose prefill chunk ran in this step
    prompt_logprobs: dict[str, tuple[int, list[tuple[float, list[tuple[int, float]], int]]]]
    # by request id: the requests this step could not serve (their input, or an error of theirs
    # alone); they got no token and are to be failed, the others go on
    failed: dict[str, RequestError] = field(default_factory=dict)
    # by request id: tokens proposed to follow the step's last token, for the next step to verify
    drafts: dict[str, list[int]] = field(default_factory=dict)


PROMPT_LOGPROBS_ROWS = 256  # prompt positions per lm_head call: bounds the [rows, vocab] logits


@dataclass
class StepTensors:
    """A forward pass's inputs as host values, from which the attention metadata is built: what
    rank 0 sends the other ranks of a tensor-parallel engine, each of which builds the same."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor  # every new token's cache slot
    starts: list[int]  # per row (a decode) or chunk: tokens computed before this step
    lens: list[int]  # and new tokens
    tables: torch.Tensor  # padded block tables [rows, max_blocks]
    state_slots: list[int] | None = None  # recurrent layers: where each row or chunk leaves its state
    state_src_slots: list[int] | None = None  # and, verifying proposals, where decode rows start from
    fresh_state_slots: list[int] | None = None  # slots of sequences starting from their first token

    def metadata(self, block_size: int, sliding_window: int | None, device: torch.device) -> AttentionMetadata:
        meta = build_metadata(self.slots, self.starts, self.lens, self.tables, block_size, sliding_window, device)
        if self.state_slots is not None:
            meta.state_slots = torch.tensor(self.state_slots, dtype=torch.long, device=device)
        if self.state_src_slots is not None:
            meta.state_src_slots = torch.tensor(self.state_src_slots, dtype=torch.long, device=device)
        return meta

    def fresh_slots(self, device: torch.device) -> torch.Tensor | None:
        return torch.tensor(self.fresh_state_slots, dtype=torch.long, device=device) if self.fresh_state_slots \
            else None


def zero_states(layer_caches: list, slots: torch.Tensor) -> None:
    """Zero these slots of every recurrent layer's state (a sequence's first step)."""
    for cache in layer_caches:
        if isinstance(cache, dict):
            for tensor in cache.values():
                tensor.index_fill_(0, slots, 0)


def copy_state_slots(layer_caches: list, src: list[int], dst: list[int], device: torch.device) -> None:
    """state[dst] = state[src] in every recurrent layer."""
    src_t = torch.tensor(src, dtype=torch.long, device=device)
    dst_t = torch.tensor(dst, dtype=torch.long, device=device)
    for cache in layer_caches:
        if isinstance(cache, dict):
            for tensor in cache.values():
                tensor[dst_t] = tensor[src_t]


@dataclass
class ModelInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    order: list[int]  # batch index of each request in model order (decodes first)
    logits_indices: list[int]  # flattened-token index of the last token of each request, model order
    step: StepTensors  # the host values the metadata was built from
    # recurrent layers: per request (batch index) verifying proposals, where its states after each
    # token are kept (see ModelRunner._checkpoints)
    state_checkpoints: dict[int, list[int]] = field(default_factory=dict)


def allocate_caches(specs: list[CacheSpec], platform: Platform, *, num_blocks: int, block_size: int,
                    num_slots: int, zero: bool = False, huge_pages: bool = False) -> list:
    """One entry per layer, as its spec says: (K, V) paged tensors for attention (PagedKV), {name: [slots,
    *shape]} for a per-sequence state. ``zero``: filled with zeros (else untouched memory)."""
    def new(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        t = platform.new_cache_tensor(shape, dtype, huge_pages)
        return t.zero_() if zero else t

    caches: list = []
    for spec in specs:
        if isinstance(spec, AttentionSpec):
            fmt = spec.format
            shape = kv_cache_shape(num_blocks, block_size, spec.num_kv_heads, fmt.row_width)
            caches.append(PagedKV(new(shape, fmt.storage_dtype), new(shape, fmt.storage_dtype), fmt))
        elif isinstance(spec, StateSpec):
            caches.append({t.name: new((num_slots, *t.shape), t.dtype) for t in spec.tensors})
        else:
            raise TypeError(f"unknown cache spec {spec!r}")
    return caches


class ModelRunner:
    def __init__(self, model: torch.nn.Module, caches: CacheManagers, platform: Platform, specs: list[CacheSpec],
                 sampler: Sampler, *, compile_mode: str = "none", compile_fullgraph: bool = False,
                 decode_executor: Any = None, huge_pages: bool = False, profiler: Any = None,
                 max_model_len: int = 1 << 62, speculative: SpeculativeDecoder | None = None,
                 workers: Any = None) -> None:
        """``decode_executor``: the platform's executor of decode-only steps, or None (eager); it may
        ask for spare KV blocks (CUDA graphs' padded rows write into one). ``huge_pages``: on CPU,
        the caches live on transparent huge pages (platforms/cpu/host_memory.py). ``speculative``:
        the proposer of the tokens each step verifies (speculative decoding), or None. ``workers``:
        the other ranks of a tensor-parallel model (parallel/workers.py's WorkerGroup), which run
        every forward pass, logits and state copy with this rank; None on one device."""
        self.model = model
        self.workers = workers
        self.max_model_len = max_model_len
        self.speculative = speculative
        self.num_speculative_tokens = speculative.config.num_speculative_tokens if speculative else 0
        self.profiler = profiler  # --profile-runtime: sampling is one of its regions
        self.model_forward = model.forward if compile_mode == "none" else \
            CompiledForward(model, compile_mode, compile_fullgraph)
        self.caches = caches
        self.kv = caches.kv
        self.platform = platform
        self.device = platform.device
        self.sampler = sampler
        self.specs = specs
        self.decode_executor = decode_executor
        spare = decode_executor.spare_blocks if decode_executor is not None else 0
        self.layer_caches = allocate_caches(specs, platform, num_blocks=self.kv.num_blocks + spare,
                                            block_size=self.kv.block_size,
                                            num_slots=caches.state.total_slots if caches.state else 0,
                                            huge_pages=huge_pages)
        self.kv_caches = [c for c in self.layer_caches if isinstance(c, tuple)]  # the paged layers'
        proposer_specs = getattr(speculative.proposer, "cache_specs", None) if speculative else None
        if proposer_specs:  # a draft model's or MTP layer's KV: in the same blocks as the target's
            proposer_caches = allocate_caches(proposer_specs, platform, num_blocks=self.kv.num_blocks + spare,
                                              block_size=self.kv.block_size, num_slots=0, huge_pages=huge_pages)
            speculative.proposer.attach(proposer_caches, self.kv.block_ids)
            self.kv_caches += proposer_caches  # (a block's rows of both are released and cached together)
        if decode_executor is not None:
            decode_executor.attach(self.layer_caches, pad_block=self.kv.num_blocks)
        if workers is not None:  # the same caches on every rank, each of its own KV heads
            workers.send("allocate_caches", self.kv.num_blocks + spare, self.kv.block_size,
                         caches.state.total_slots if caches.state else 0)

    def prepare(self, requests: list[Request], num_new_tokens: list[int],
                spec_token_ids: list[list[int]] | None = None) -> ModelInputs:
        """The step's input tensors and metadata. A request verifying proposed tokens feeds its last
        token and the proposals, each a decode row of its own: row j attends to the rows before it
        through the KV they write first, and (recurrent layers) continues the state the row before
        it left in a checkpoint slot; so a step of verifications stays a decode step, which the
        platform's decode executor runs."""
        bs = self.kv.block_size
        spec = spec_token_ids or [[]] * len(requests)
        order = sorted(range(len(requests)), key=lambda i: num_new_tokens[i] - len(spec[i]) != 1)  # decodes first
        state = self.caches.state
        checkpoints = self._checkpoints(order, spec) if state is not None else {}
        ids: list[int] = []
        starts: list[int] = []
        lens: list[int] = []
        tables: list[list[int]] = []
        state_dst: list[int] = []  # per row (decodes) or chunk: the state slot it leaves its state in
        state_src: list[int] = []  # and the one it starts from
        last_rows: list[int] = []
        on_device: list[tuple[int, tuple[torch.Tensor, int]]] = []  # (flat index, pending token)
        for i in order:
            req, n, proposed = requests[i], num_new_tokens[i], spec[i]
            start = req.num_computed_tokens
            if req.pending:  # tokens not yet read back: take them from where they were sampled
                first = req.num_tokens - len(req.pending)
                on_device.extend((len(ids) + pos - start, req.pending[pos - first])
                                 for pos in range(max(start, first), start + n))
            ids.extend(req.all_token_ids[start:start + n - len(proposed)])
            ids.extend(proposed)
            table = self.kv.block_ids(req.request_id)
            slot = state.slot(req.request_id) if state is not None else -1
            if proposed:
                starts.extend(range(start, start + n))
                lens.extend([1] * n)
                tables.extend([table] * n)
                chain = checkpoints.get(i, [])
                state_src.extend([slot] + chain)
                state_dst.extend(chain + [slot])
            else:
                starts.append(start)
                lens.append(n)
                tables.append(table)
                state_src.append(slot)
                state_dst.append(slot)
            last_rows.append(len(ids) - 1)
        dev = self.device
        positions, table_tensor, slots = token_slots(starts, lens, tables, bs)
        step = StepTensors(torch.tensor(ids, dtype=torch.long), positions, slots, starts, lens, table_tensor)
        if state is not None:
            step.state_slots = state_dst
            if checkpoints:
                step.state_src_slots = state_src[:sum(1 for n in lens if n == 1)]
            step.fresh_state_slots = [slot for slot, start in zip(state_dst, starts) if start == 0]
        meta = step.metadata(bs, self.model.config.sliding_window, dev)
        input_ids = step.input_ids.to(dev)
        if on_device:
            where = torch.tensor([flat for flat, _ in on_device], device=dev)
            input_ids[where] = torch.stack([t[row] for _, (t, row) in on_device])
        return ModelInputs(input_ids, positions.to(dev), meta, order, last_rows, step, checkpoints)

    def _checkpoints(self, order: list[int], spec: list[list[int]]) -> dict[int, list[int]]:
        """For recurrent layers: per request (batch index) that verifies k proposals, k checkpoint
        slots that keep its states after each of its tokens but the last (its own slot gets the
        state after the last), so that the runner can roll back to the last accepted token. They
        go back (``_settle_checkpoints``) when the step ends, whatever happens in it."""
        state = self.caches.state
        return {i: state.take_checkpoints(len(spec[i])) for i in order if spec[i]}

    def _settle_checkpoints(self, inputs: ModelInputs, requests: list[Request], accepted: dict[int, int]) -> None:
        """After the step: a request whose proposal was rejected after ``accepted[i]`` tokens takes
        that token's checkpoint as its state slot (no copy); every other checkpoint is freed."""
        state = self.caches.state
        for i, chain in inputs.state_checkpoints.items():
            a = accepted.get(i)
            if a is not None and a < len(chain):
                chain = chain[:a] + chain[a + 1:] + [state.move(requests[i].request_id, chain[a])]
            state.return_checkpoints(chain)
        inputs.state_checkpoints.clear()

    @torch.inference_mode()
    def forward(self, inputs: ModelInputs) -> torch.Tensor:
        """Hidden states of every scheduled token, in model order."""
        if self.workers is not None:  # the tokens as they are now (a pending one filled in on the device)
            self.workers.send("forward", dataclasses.replace(inputs.step, input_ids=inputs.input_ids.cpu()))
        with self._with_workers():
            fresh = inputs.step.fresh_slots(self.device)
            if fresh is not None:  # a sequence's first step starts from a zero state
                zero_states(self.layer_caches, fresh)
            executor = self.decode_executor
            with self.platform.numerics():
                if executor is not None and executor.applies(inputs.meta, inputs.input_ids.shape[0],
                                                             self.layer_caches):
                    return executor.run(inputs.input_ids, inputs.positions, self.layer_caches, inputs.meta)
                return self.model_forward(inputs.input_ids, inputs.positions, self.layer_caches, inputs.meta)

    @contextmanager
    def _with_workers(self):
        """Around this rank's part of a model call the other ranks also run: if it fails, they
        may be left inside it, so the tensor-parallel group is done (parallel/workers.py)."""
        try:
            yield
        except BaseException as exc:
            if self.workers is not None:
                self.workers.broken(exc)
            raise

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
        self.copy_states(batch.state_restores)
        inputs = self.prepare(batch.requests, batch.num_new_tokens, batch.spec_token_ids)
        failed: dict[str, RequestError] = {}
        accepted: dict[int, int] = {}  # batch index -> proposals accepted, for the recurrent states
        try:
            hidden = self.forward(inputs)
            self.copy_states([save for _, save in batch.state_saves])
            sampled = self._sample(batch, inputs, hidden, failed, accepted)
        finally:
            if inputs.state_checkpoints:
                self._settle_checkpoints(inputs, batch.requests, accepted)
        drafts = self.speculative.after_step(batch, inputs, hidden, sampled) if self.speculative else {}
        return StepResult(sampled, self._prompt_logprobs(batch, inputs, hidden, failed), failed, drafts)

    def forget(self, request_id: str) -> None:
        """A request ended: drop what the sampler and the proposer kept for it."""
        self.sampler.forget(request_id)
        if self.speculative is not None:
            self.speculative.forget(request_id)

    @torch.inference_mode()
    def copy_states(self, copies: list) -> None:
        """Copy state slots (cache_managers.StateCopy: a snapshot in, a sequence's state out) in
        every recurrent layer."""
        if not copies:
            return
        src, dst = [c.src for c in copies], [c.dst for c in copies]
        if self.workers is not None:
            self.workers.send("copy_states", src, dst)
        copy_state_slots(self.layer_caches, src, dst, self.device)  # (no collective: nothing to wait in)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of these hidden states (every rank computes its slice of the vocabulary)."""
        if self.workers is not None:
            self.workers.send("compute_logits", hidden.cpu())
        with self._with_workers():
            return self.model.compute_logits(hidden)

    def check_device(self) -> None:
        """Raise if the device (or another rank) can no longer run anything (after a failed step)."""
        if self.workers is not None:
            self.workers.check()
        self.platform.synchronize()

    def read_back(self, refs: list[tuple[torch.Tensor, int]]) -> list[int]:
        """Sampled tokens left on the device (the sync window): (tensor, row) each, in one copy."""
        return torch.stack([t[row] for t, row in refs]).tolist()

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
                    logits = self.compute_logits(hidden[first_row + a - start:first_row + b - start])
                    entries += token_logprobs(logits, req.all_token_ids[a + 1:b + 1], [k] * (b - a))
            except Exception as exc:  # this request's alone: the others keep theirs
                log.exception("prompt logprobs failed for request %s", req.request_id)
                failed[req.request_id] = RequestError.internal(exc)
                continue
            out[req.request_id] = (start + 1, entries)
        return out

    def _sample(self, batch: ScheduledBatch, inputs: ModelInputs, hidden: torch.Tensor,
                failed: dict[str, RequestError], accepted: dict[int, int]) -> dict[str, SampledToken]:
        spec = batch.spec_token_ids or [[]] * len(batch.requests)
        sampling = [(pos, i) for pos, i in enumerate(inputs.order)
                    if batch.requests[i].num_computed_tokens + batch.num_new_tokens[i] - len(spec[i])
                    == batch.requests[i].num_tokens]
        if not sampling:
            return {}
        reqs = [batch.requests[i] for _, i in sampling]
        proposals = [spec[i] for _, i in sampling]
        rows = [list(range(inputs.logits_indices[pos] - len(spec[i]), inputs.logits_indices[pos] + 1))
                for pos, i in sampling]
        logits = self.compute_logits(hidden[torch.tensor([r for rs in rows for r in rs], device=self.device)])
        with nullcontext() if self.profiler is None else self.profiler.region("sampling"):
            if any(proposals):
                return self._verify(logits, rows, reqs, proposals, [i for _, i in sampling], failed, accepted)
            result: SampleResult = self.sampler(logits, reqs)
        for i, error in result.failed.items():
            failed[reqs[i].request_id] = error
        host = result.tokens.tolist() if any(r.sync_every == 1 for r in reqs) else None
        return {r.request_id: SampledToken(host[i] if host is not None and r.sync_every == 1 else None,
                                           result.logprobs[i], (result.tokens, i))
                for i, r in enumerate(reqs) if i not in result.failed}

    def _verify(self, logits: torch.Tensor, rows: list[list[int]], reqs: list[Request], proposals: list[list[int]],
                batch_index: list[int], failed: dict[str, RequestError],
                accepted: dict[int, int]) -> dict[str, SampledToken]:
        """A step with proposals to verify (speculative/verify.py); ``accepted``: how many of each
        request's proposals were kept (by batch index)."""
        first = 0
        flat_rows = []
        for r in rows:
            flat_rows.append(list(range(first, first + len(r))))
            first += len(r)
        found = verify(self.sampler, logits, flat_rows, reqs, proposals, self.max_model_len)
        out = {}
        for k, req in enumerate(reqs):
            if k in found.failed:
                failed[req.request_id] = found.failed[k]
                continue
            tokens, lps = found.tokens[k], found.logprobs[k]
            out[req.request_id] = SampledToken(tokens[-1], lps[-1], None, tokens[:-1], lps[:-1])
            accepted[batch_index[k]] = len(tokens) - 1
        return out
