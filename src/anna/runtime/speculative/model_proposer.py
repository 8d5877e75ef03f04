"""Proposals from weights: a draft model (a smaller checkpoint with the target's tokenizer) or the
target's own multi-token-prediction layer. Both keep their own KV in blocks of the same pool
(the target's block tables and slots: a request's blocks hold the target's rows and the
proposer's), are run by the runner after each step, and propose greedily.

After a step, the proposer first catches up: it runs over the tokens the step computed for every
request in it (accepted ones only), so that its KV always covers what the target's covers (a
prefix shared through the cache is shared for both). For a request that may propose next, the
catch-up also yields the first proposal, then K-1 single-token steps give the rest. The slots
those steps write beyond the computed tokens are the scheduler's lookahead slots; the next step
overwrites them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from anna.model.attention import build_metadata, token_slots
from anna.platforms import Platform
from anna.runtime.speculative.decoder import ProposalStep


@dataclass
class CatchUp:
    """What the proposer runs for one request after a step."""

    request_index: int
    token_ids: list[int]
    first_position: int
    target_rows: list[int]  # the step's hidden-state rows these entries read (MTP), else empty
    proposes: bool  # its last entry's prediction is the first proposal


class ModelProposer:
    """The shared loop; a subclass says what to run (``entries``, ``forward``, ``logits``)."""

    lookahead: int
    sliding_window: int | None = None  # of the proposer's attention layers

    def __init__(self, num_tokens: int, block_size: int, platform: Platform, vocab_size: int) -> None:
        self.num_tokens = num_tokens
        self.block_size = block_size
        self.platform = platform
        self.vocab_size = vocab_size  # the target's: proposals outside it are never made
        self.caches: list = []
        self.block_ids = None  # request id -> block ids (the KV manager's), set by attach

    def attach(self, caches: list, block_ids) -> None:
        self.caches = caches
        self.block_ids = block_ids

    # ---- what a subclass provides ----
    def entries(self, step: ProposalStep, i: int, start: int, computed: int) -> CatchUp:
        raise NotImplementedError

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor | None,
                meta) -> torch.Tensor:
        raise NotImplementedError

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forget(self, request_id: str) -> None:
        pass

    # ---- the loop ----
    @torch.inference_mode()
    def propose(self, step: ProposalStep) -> dict[str, list[int]]:
        catch_ups = []
        for i, req in enumerate(step.requests):
            token = step.sampled.get(req.request_id)
            prefill_chunk = req.num_computed_tokens + step.num_new_tokens[i] < req.num_tokens
            if token is None and not prefill_chunk:
                continue  # failed in this step
            computed = step.num_new_tokens[i] - len(step.spec_token_ids[i]) + (len(token.accepted) if token else 0)
            catch_ups.append(self.entries(step, i, req.num_computed_tokens, computed))
        catch_ups.sort(key=lambda c: len(c.token_ids) != 1)  # decodes first, as the metadata wants
        if not catch_ups:
            return {}
        hidden = self._run(step, catch_ups)
        proposing = [c for c in catch_ups if c.proposes]
        if not proposing:
            return {}
        ends = torch.tensor([len(c.token_ids) for c in catch_ups]).cumsum(0) - 1
        last_hidden = hidden[ends[[k for k, c in enumerate(catch_ups) if c.proposes]].to(hidden.device)]
        active = [step.requests[c.request_index].request_id for c in proposing]
        drafts = {rid: [t] for rid, t in zip(active, self._argmax(last_hidden))}
        wanted = {rid: step.lengths[c.request_index] for rid, c in zip(active, proposing)}
        position = {rid: c.first_position + len(c.token_ids) for rid, c in zip(active, proposing)}
        while True:  # one token more for each request that wants more (a back-off probe wants one)
            keep = [j for j, rid in enumerate(active) if len(drafts[rid]) < wanted[rid]]
            if not keep:
                return drafts
            active = [active[j] for j in keep]
            last_hidden = self._step(active, [drafts[r][-1] for r in active], [position[r] for r in active],
                                     last_hidden[keep])
            for rid, t in zip(active, self._argmax(last_hidden)):
                drafts[rid].append(t)
                position[rid] += 1

    def _argmax(self, hidden: torch.Tensor) -> list[int]:
        return self.logits(hidden)[:, :self.vocab_size].argmax(dim=-1).tolist()

    def _run(self, step: ProposalStep, catch_ups: list[CatchUp]) -> torch.Tensor:
        rows = [r for c in catch_ups for r in c.target_rows]
        target = step.hidden[torch.tensor(rows, device=step.hidden.device)] if rows else None
        return self._forward_rows([t for c in catch_ups for t in c.token_ids], [c.first_position for c in catch_ups],
                                  [len(c.token_ids) for c in catch_ups],
                                  [self.block_ids(step.requests[c.request_index].request_id) for c in catch_ups],
                                  target)

    def _step(self, request_ids: list[str], ids: list[int], positions: list[int],
              hidden: torch.Tensor) -> torch.Tensor:
        tables = [self.block_ids(r) for r in request_ids]
        return self._forward_rows(ids, positions, [1] * len(ids), tables, hidden)

    def _forward_rows(self, ids: list[int], starts: list[int], lens: list[int], tables: list[list[int]],
                      hidden: torch.Tensor | None) -> torch.Tensor:
        bs, dev = self.block_size, self.platform.device
        positions, table_tensor, slots = token_slots(starts, lens, tables, bs)
        meta = build_metadata(slots, starts, lens, table_tensor, bs, self.sliding_window, dev)
        with self.platform.numerics():
            return self.forward(torch.tensor(ids, dtype=torch.long, device=dev), positions.to(dev), hidden, meta)


class DraftModelProposer(ModelProposer):
    """A smaller model of the same tokenizer: its catch-up runs the step's computed tokens and,
    for a request that proposes, the step's new token, whose prediction is the first proposal."""

    def __init__(self, model: torch.nn.Module, num_tokens: int, block_size: int, platform: Platform,
                 vocab_size: int, decode_executor=None) -> None:
        super().__init__(num_tokens, block_size, platform, vocab_size)
        self.model = model
        self.lookahead = num_tokens  # the new token's slot and K - 1 proposals' beyond the step
        self.sliding_window = model.config.sliding_window
        self.decode_executor = decode_executor

    def entries(self, step: ProposalStep, i: int, start: int, computed: int) -> CatchUp:
        req = step.requests[i]
        known = req.all_token_ids + step.new_tokens(i)
        proposes = step.lengths[i] > 0
        return CatchUp(i, known[start:start + computed + (1 if proposes else 0)], start, [], proposes)

    def forward(self, input_ids, positions, hidden, meta) -> torch.Tensor:
        executor = self.decode_executor
        if executor is not None and executor.applies(meta, input_ids.shape[0], self.caches):
            return executor.run(input_ids, positions, self.caches, meta)
        return self.model(input_ids, positions, self.caches, meta)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)
