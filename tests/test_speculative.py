"""Speculative decoding: outputs are those of plain decoding (greedy: the same tokens; sampled:
the same distribution), whatever the proposer, the architecture, the batch around a speculating
sequence, chunked prefill, preemption and prefix hits; rejected proposals leave no trace."""

from __future__ import annotations

import json
import random

import pytest
import torch

from anna.core.request import Request
from anna.core.sampling_params import SamplingParams, StructuredOutputsParams
from anna.core.speculative import SpeculativeConfig, parse_speculative_config
from anna.runtime.engine import LLMEngine
from anna.runtime.sampler import Sampler
from anna.runtime.speculative.backoff import AcceptanceBackoff
from anna.runtime.speculative.decoder import ProposalStep, SpeculativeDecoder
from anna.runtime.speculative.ngram import NgramProposer
from anna.runtime.speculative.verify import verify
from conftest import engine_settings

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
FAMILIES = ["llama3", "mistral_swa", "qwen2", "qwen3", "mixtral", "qwen3_moe", "qwen3_5", "qwen3_5_moe", "qwen3_next"]


def make_engine(path, cache_dir, spec=None, **kw) -> LLMEngine:
    return LLMEngine(engine_settings(path, cache_dir, speculative_config=json.dumps(spec) if spec else "", **kw),
                     show_progress=False)


def drain(engine: LLMEngine, requests: list[tuple], max_steps: int = 5000) -> dict:
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    out, steps = {}, 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                out[o.request_id] = o
        steps += 1
        assert steps < max_steps
    return out


def assert_pool_free(engine: LLMEngine) -> None:
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    assert all(b.ref_cnt == 0 for b in engine.kv.pool.blocks)
    state = engine.scheduler.caches.state
    assert state is None or (state.num_free == state.num_slots
                             and len(state.free_checkpoints) == state.num_checkpoints)


def looping_prompts(n: int = 4, seed: int = 0) -> list[list[int]]:
    """Prompts with repeated stretches, so that prompt lookup finds matches from the start."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        motif = [rng.randrange(3, 700) for _ in range(rng.randrange(3, 9))]
        out.append([rng.randrange(3, 700) for _ in range(rng.randrange(2, 12))] + motif * rng.randrange(3, 7))
    return out


def greedy(max_tokens: int = 40, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


class OracleProposer:
    """Proposes the continuation plain decoding produced, with one token in the proposal made
    wrong at a position that changes from step to step: every count of accepted tokens, 0..K,
    happens, so every rollback is exercised."""

    lookahead = 0

    def __init__(self, reference: dict[str, list[int]], prompts: dict[str, list[int]], k: int, seed: int = 0) -> None:
        self.reference, self.prompts, self.k = reference, prompts, k
        self.rng = random.Random(seed)

    def propose(self, step: ProposalStep) -> dict[str, list[int]]:
        out = {}
        for i, req in enumerate(step.requests):
            if not step.lengths[i]:
                continue
            done = req.num_output_tokens + len(step.new_tokens(i))
            truth = self.reference[req.request_id][done:done + self.k]
            if not truth:
                continue
            wrong = self.rng.randrange(len(truth) + 1)  # len(truth): all right
            out[req.request_id] = [t if j != wrong else (t + 1) % 700 for j, t in enumerate(truth)]
        return out

    def forget(self, request_id: str) -> None:
        pass


# ---- configuration ----
def test_config_is_resolved_with_defaults_and_checked():
    assert json.loads(parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 3}')) == {
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 5, "prompt_lookup_max": 5,
        "disable_by_batch_size": 0, "min_acceptance_rate": 0.2}
    assert json.loads(parse_speculative_config({"model": "/d", "num_speculative_tokens": 2}))["method"] == "draft_model"
    assert parse_speculative_config("") == "" and parse_speculative_config(None) == ""
    for bad, field in [('{"method": "eagle", "num_speculative_tokens": 2}', "method"),
                       ('{"method": "ngram"}', "num_speculative_tokens"),
                       ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
                       ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, '
                        '"prompt_lookup_max": 2}', "prompt_lookup_min"),
                       ('{"method": "draft_model", "num_speculative_tokens": 2}', "model"),
                       ('{"method": "mtp", "num_speculative_tokens": 2, "prompt_lookup_max": 3}', "prompt_lookup_max"),
                       ('{"method": "ngram", "num_speculative_tokens": 2, "typo": 1}', "typo"),
                       ("[1]", "speculative_config"), ("{", "speculative_config")]:
        with pytest.raises(ValueError, match=f"speculative_config(\\.{field})?:"):
            parse_speculative_config(bad)


def test_setting_from_env_keyword_and_table(qwen2_dir, cache_dir):
    from anna.core.config import ServeSettings

    resolved = ServeSettings().resolve(env={"ANNA_SPECULATIVE_CONFIG": '{"method":"ngram","num_speculative_tokens":2}'})
    assert json.loads(resolved.speculative_config)["prompt_lookup_max"] == 5
    assert resolved.sources["speculative_config"] == "env"
    assert '"num_speculative_tokens": 2' in resolved.table()
    from anna import LLM

    llm = LLM(str(qwen2_dir), dtype="float32", device="cpu", cache_dir=str(cache_dir), max_model_len=256,
              num_gpu_blocks_override=64, speculative_config=NGRAM)
    assert llm.llm_engine.runner.speculative is not None
    with pytest.raises(ValueError, match="speculative_config.num_speculative_tokens"):
        LLM(str(qwen2_dir), speculative_config={"method": "ngram", "num_speculative_tokens": 99})


# ---- the n-gram proposer ----
def test_ngram_lookup_takes_the_longest_most_recent_match():
    p = NgramProposer(3, 1, 3)
    tokens = [1, 2, 3, 9, 8, 1, 2, 3, 7, 6, 5, 4, 2, 3]
    assert p.lookup("a", tokens) == [7, 6, 5]  # (2, 3) last seen before 7; the 3-gram (4, 2, 3) never
    assert p.lookup("a", tokens + [7, 6]) == [5, 4, 2]  # the index grows with the tokens
    assert NgramProposer(3, 2, 2).lookup("b", [5, 6, 7, 8]) == []
    assert NgramProposer(4, 1, 2).lookup("c", [1, 2, 1, 2]) == [1, 2, 1, 2]  # a repeating stretch continues
    assert NgramProposer(5, 1, 1).lookup("d", [3, 3, 3]) == [3] * 5


def test_backoff_pauses_probes_with_one_token_and_resumes():
    b = AcceptanceBackoff(0.5)
    for _ in range(2):
        assert b.allowed("r", 4) == 4
        b.observe("r", 4, 1)  # 2 of 8: below the rate
    assert [b.allowed("r", 4) for _ in range(5)] == [0, 0, 0, 0, 1]  # a pause of 4 steps, then a probe
    b.observe("r", 1, 0)  # the probe fails: the pause doubles
    assert [b.allowed("r", 4) for _ in range(9)] == [0] * 8 + [1]
    b.observe("r", 1, 1)  # it is accepted: full proposals again
    assert b.allowed("r", 4) == 4
    b.observe("r", 4, 4), b.observe("r", 4, 3)
    assert b.allowed("r", 4) == 4
    assert AcceptanceBackoff(0.0).allowed("x", 3) == 3


# ---- verification: the speculative-sampling rule ----
def _request(rid: str, params: SamplingParams, output: list[int] = ()) -> Request:
    req = Request(rid, [1, 2, 3], params)
    for t in output:
        req.append_output_token(t)
    return req


def test_rejection_sampling_keeps_the_target_distribution():
    """Position 0's token is distributed as the target's p0 whatever the proposal; given the
    proposal was accepted, position 1's is distributed as p1. A rule that kept the proposal too
    often, or drew the correction from p0 without excluding the proposal (the residual not
    renormalised), moves the histogram far past the bound."""
    torch.manual_seed(0)
    vocab = 6
    p0 = torch.tensor([0.30, 0.25, 0.20, 0.12, 0.08, 0.05])
    p1 = torch.tensor([0.05, 0.05, 0.50, 0.20, 0.10, 0.10])
    logits = torch.stack([p0.log(), p1.log(), p1.log()])  # the last row: position 2 (never reached in the count)
    sampler = Sampler(seed=1234, device=torch.device("cpu"))
    params = SamplingParams(temperature=1.0, max_tokens=100)
    n, batch = 20000, 500  # verified 500 requests a step, as a busy server would
    first = torch.zeros(vocab)
    second = torch.zeros(vocab)
    accepted0 = 0
    rows = [[3 * b, 3 * b + 1, 3 * b + 2] for b in range(batch)]
    for step in range(n // batch):
        requests = [_request(f"r{step}-{b}", params) for b in range(batch)]
        found = verify(sampler, logits.repeat(batch, 1), rows, requests, [[1, 4]] * batch, max_model_len=1 << 20)
        for tokens in found.tokens:
            first[tokens[0]] += 1
            if tokens[0] == 1:
                accepted0 += 1
                second[tokens[1]] += 1
    assert abs(accepted0 / n - p0[1]) < 0.015  # P(accept) = p(d)
    assert (first / n - p0).abs().max() < 0.015
    assert (second / second.sum() - p1).abs().max() < 0.03


def test_verification_sees_penalties_and_bans_of_the_accepted_tokens():
    """Position j is sampled as if the accepted proposals were already output: a proposal that
    a penalty or a bad word would forbid after the ones before it is rejected."""
    sampler = Sampler(seed=0, device=torch.device("cpu"))
    logits = torch.zeros(3, 8)
    logits[:, 5] = 5.0  # token 5 is every position's favourite
    logits[:, 6] = 4.0
    plain = _request("a", SamplingParams(temperature=0, max_tokens=10))
    assert verify(sampler, logits, [[0, 1, 2]], [plain], [[5, 5]], 1 << 20).tokens[0] == [5, 5, 5]
    penalized = _request("b", SamplingParams(temperature=0, max_tokens=10, repetition_penalty=2.0))
    found = verify(sampler, logits, [[0, 1, 2]], [penalized], [[5, 5]], 1 << 20)
    assert found.tokens[0] == [5, 6]  # after one 5, the penalty (5 / 2 < 4) makes 6 the argmax
    assert penalized.output_token_ids == [] and penalized.all_token_ids == [1, 2, 3]  # taken back


def test_verification_stops_at_a_token_that_ends_the_request():
    sampler = Sampler(seed=0, device=torch.device("cpu"))
    logits = torch.zeros(3, 8)
    logits[0, 2], logits[1, 7], logits[2, 4] = 5.0, 5.0, 5.0
    req = _request("a", SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[7]))
    assert verify(sampler, logits, [[0, 1, 2]], [req], [[2, 7]], 1 << 20).tokens[0] == [2, 7]
    short = _request("b", SamplingParams(temperature=0, max_tokens=1))
    assert verify(sampler, logits, [[0, 1, 2]], [short], [[2, 7]], 1 << 20).tokens[0] == [2]


# ---- the engine: greedy outputs unchanged ----
def use_oracle(engine: LLMEngine, reference: dict, requests: list[tuple], k: int = 4) -> None:
    engine.runner.speculative = SpeculativeDecoder(SpeculativeConfig("ngram", k, 1, 1, min_acceptance_rate=0),
                                                   OracleProposer(reference, {r: p for r, p, _ in requests}, k))


def assert_rollbacks_of_every_length(engine: LLMEngine, k: int = 4) -> None:
    spec = engine.stats.spec
    assert spec.num_drafts > 10 and len(spec.accepted_per_pos) == k
    assert 0 < spec.accepted_per_pos[-1] < spec.accepted_per_pos[0] < spec.num_drafts


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_outputs_equal_plain_decoding(hf_models, cache_dir, family):
    """Every architecture family: with prompt lookup, and with proposals wrong at every position
    (0..K accepted, so KV and recurrent states go back to every point), speculating requests
    batched with an opted-out one; every KV block and state slot comes back."""
    path = hf_models[family][1]
    requests = [(f"r{i}", p, greedy(speculative=i != 1)) for i, p in enumerate(looping_prompts())]
    plain_engine = make_engine(path, cache_dir)
    plain = drain(plain_engine, requests)
    reference = {rid: o.outputs[0].token_ids for rid, o in plain.items()}
    engine = make_engine(path, cache_dir, NGRAM)
    assert {rid: o.outputs[0].token_ids for rid, o in drain(engine, requests).items()} == reference
    assert_pool_free(engine)
    engine = make_engine(path, cache_dir, NGRAM)
    use_oracle(engine, reference, requests)
    assert {rid: o.outputs[0].token_ids for rid, o in drain(engine, requests).items()} == reference
    assert_rollbacks_of_every_length(engine)
    assert_pool_free(engine)
    # prefix-cache blocks are hashed over accepted tokens only: the same blocks as plain decoding cached
    assert set(engine.kv.pool.cached) == set(plain_engine.kv.pool.cached)


@pytest.mark.parametrize("path", [dict(decode_executor="eager"), dict(cpu_kernels=False)], ids=["eager", "torch"])
@pytest.mark.parametrize("family", ["qwen2", "qwen3_5"])
def test_every_execution_path_verifies_the_same(hf_models, cache_dir, family, path):
    """The fused decode stack serves verification by default (the tests above); layer by layer
    with Anna's kernels, and with torch's ops alone, rows that chain their states give the same."""
    model_dir = hf_models[family][1]
    requests = [(f"r{i}", p, greedy(24)) for i, p in enumerate(looping_prompts(3, seed=8))]
    plain = drain(make_engine(model_dir, cache_dir, **path), requests)
    reference = {rid: o.outputs[0].token_ids for rid, o in plain.items()}
    engine = make_engine(model_dir, cache_dir, NGRAM, **path)
    use_oracle(engine, reference, requests)
    assert {rid: o.outputs[0].token_ids for rid, o in drain(engine, requests).items()} == reference
    assert engine.stats.spec.num_accepted_tokens > 0
    assert_pool_free(engine)


# Long prompts in small chunks, a KV pool small enough to preempt, requests that share a prefix
PRESSURE = dict(num_gpu_blocks_override=24, block_size=8, max_num_batched_tokens=32, long_prefill_token_threshold=16,
                max_model_len=192)


def pressure_workload() -> list[tuple]:
    rng = random.Random(3)
    shared = (looping_prompts(1, seed=5)[0] * 4)[:64]
    prompts = [shared + [rng.randrange(3, 700) for _ in range(rng.randrange(1, 20))] for _ in range(3)]
    prompts += looping_prompts(3, seed=6)
    return [(f"r{i}", p, greedy(64)) for i, p in enumerate(prompts)]


@pytest.mark.parametrize("family", ["qwen2", "qwen3_5"])
def test_chunked_prefill_preemption_and_prefix_hits(hf_models, cache_dir, family):
    """PRESSURE: the same tokens as plain decoding under the same pressure, and no leak."""
    path = hf_models[family][1]
    requests = pressure_workload()
    plain = drain(make_engine(path, cache_dir, **PRESSURE), requests)
    reference = {rid: o.outputs[0].token_ids for rid, o in plain.items()}
    for oracle in (False, True):
        engine = make_engine(path, cache_dir, NGRAM, **PRESSURE)
        if oracle:
            use_oracle(engine, reference, requests)
        got = drain(engine, requests)
        assert {rid: o.outputs[0].token_ids for rid, o in got.items()} == reference
        assert engine.scheduler.num_preemptions > 0 and engine.kv.prefix_cache_hits > 0
        assert_pool_free(engine)
    assert_rollbacks_of_every_length(engine)


def test_speculation_goes_before_preemption():
    """Two decoding sequences fill a two-block pool; proposals that would need a third block are
    dropped (no one is preempted), and with room they are scheduled and counted in the budget."""
    from anna.runtime.cache_managers import CacheManagers
    from anna.runtime.kv_cache import KVCacheManager
    from anna.runtime.scheduler import Scheduler, SchedulerConfig

    def decoding_pair(num_blocks: int, budget: int = 64) -> tuple[Scheduler, list[Request]]:
        sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget, long_prefill_token_threshold=64,
                                          prefill_interval_steps=1, event_driven_prefill_insert=True),
                          CacheManagers(KVCacheManager(num_blocks, 4, enable_prefix_caching=False)))
        reqs = [Request(f"r{i}", [3, 4, 5], greedy(10)) for i in range(2)]
        for req in reqs:
            sched.add(req)
        assert sched.schedule().num_new_tokens == [3, 3]  # the prompts: one block each
        for req in reqs:  # their first tokens: the next position still fits the first block
            req.num_computed_tokens = 3
            req.append_output_token(9)
            req.spec_token_ids = [6, 7, 8]
        return sched, reqs

    sched, reqs = decoding_pair(num_blocks=2)
    batch = sched.schedule()
    assert batch.num_new_tokens == [1, 1] and batch.spec_token_ids == [[], []] and not batch.preempted
    sched, reqs = decoding_pair(num_blocks=4)
    batch = sched.schedule()
    assert batch.num_new_tokens == [4, 4] and batch.spec_token_ids == [[6, 7, 8]] * 2
    sched, reqs = decoding_pair(num_blocks=4, budget=6)  # the token budget: 4, then 2 (1 + 1 proposal)
    assert sched.schedule().num_new_tokens == [4, 2]


def test_stop_strings_and_max_tokens_inside_an_accepted_run(qwen2_dir, cache_dir):
    prompts = looping_prompts(3, seed=4)
    plain_engine = make_engine(qwen2_dir, cache_dir)
    full = drain(plain_engine, [(f"r{i}", p, greedy(40)) for i, p in enumerate(prompts)])
    requests = []
    for i, p in enumerate(prompts):
        text = full[f"r{i}"].outputs[0].text
        stop = text[len(text) // 2:len(text) // 2 + 3].strip() or None
        requests.append((f"s{i}", p, greedy(40, stop=[stop] if stop else None)))
        requests.append((f"m{i}", p, greedy(7 + 3 * i)))
    plain = drain(plain_engine, requests)
    engine = make_engine(qwen2_dir, cache_dir, NGRAM)
    got = drain(engine, requests)
    for rid, _, _ in requests:
        a, b = got[rid].outputs[0], plain[rid].outputs[0]
        assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason), rid
    assert engine.stats.spec.num_accepted_tokens > 0
    assert engine.stats.generation_tokens == plain_engine.stats.generation_tokens - sum(
        len(o.outputs[0].token_ids) for o in full.values())
    assert_pool_free(engine)


def test_sampled_outputs_with_seeds_and_processing_match(qwen2_dir, cache_dir):
    """A seeded request draws the same random numbers in the same order with or without
    speculation, so with penalties, logit_bias, bad words, a grammar and logprobs its output is
    the same tokens (and logprobs)."""
    prompts = looping_prompts(4, seed=7)
    kinds = [dict(temperature=0.8, top_p=0.9, seed=11), dict(temperature=0.7, repetition_penalty=1.3, seed=12),
             dict(temperature=0.5, logit_bias={7: 3.0}, bad_words=["ab"], seed=13, logprobs=2),
             dict(temperature=0.6, seed=14, structured_outputs=StructuredOutputsParams(regex="[a-z ]{5,40}"))]
    requests = [(f"r{i}", p, SamplingParams(max_tokens=30, **kw)) for i, (p, kw) in enumerate(zip(prompts, kinds))]
    plain = drain(make_engine(qwen2_dir, cache_dir), requests)
    engine = make_engine(qwen2_dir, cache_dir, NGRAM)
    use_oracle(engine, {rid: o.outputs[0].token_ids for rid, o in plain.items()}, requests)
    got = drain(engine, requests)
    for rid, _, _ in requests:
        a, b = got[rid].outputs[0], plain[rid].outputs[0]
        assert a.token_ids == b.token_ids, rid
        if b.logprobs:
            assert [list(x) for x in a.logprobs] == [list(x) for x in b.logprobs]
            for x, y in zip(a.logprobs, b.logprobs):
                for t in x:
                    assert abs(x[t].logprob - y[t].logprob) < 1e-4
    assert_rollbacks_of_every_length(engine)
    assert_pool_free(engine)


# ---- a draft model ----
@pytest.mark.parametrize("target,draft", [("qwen2", "qwen2")] + [
    (family, "llama3" if family != "llama3" else "qwen2") for family in FAMILIES if family != "qwen2"])
def test_draft_model_outputs_equal_plain_decoding(hf_models, cache_dir, target, draft):
    """The draft keeps its own KV in the target's blocks; a draft that is the target itself is
    accepted every time (its KV and positions are right), any other keeps outputs unchanged."""
    path = hf_models[target][1]
    requests = pressure_workload()
    plain = drain(make_engine(path, cache_dir, **PRESSURE), requests)
    spec = {"method": "draft_model", "model": str(hf_models[draft][1]), "num_speculative_tokens": 3}
    engine = make_engine(path, cache_dir, spec, **PRESSURE)
    got = drain(engine, requests)
    for rid, _, _ in requests:
        assert got[rid].outputs[0].token_ids == plain[rid].outputs[0].token_ids, rid
    stats = engine.stats.spec
    assert stats.num_drafts > 10
    assert engine.scheduler.num_preemptions > 0 and engine.kv.prefix_cache_hits > 0
    if target == draft:  # its KV and positions are right after chunks, preemption and prefix hits
        assert stats.num_accepted_tokens == stats.num_draft_tokens
    assert_pool_free(engine)


def test_draft_model_kv_travels_with_the_exact_prompt_cache(hf_models, cache_dir):
    """A prompt restored from the exact prompt cache brings the draft's KV too: a draft that is the
    target keeps being accepted every time."""
    path = hf_models["qwen2"][1]
    spec = {"method": "draft_model", "model": str(path), "num_speculative_tokens": 3}
    engine = make_engine(path, cache_dir, spec, prompt_cache_size=2)
    prompt = looping_prompts(1, seed=3)[0]
    first = drain(engine, [("a", prompt, greedy(24))])["a"].outputs[0].token_ids
    again = drain(engine, [("b", prompt, greedy(24))])["b"].outputs[0].token_ids
    assert engine.prompt_cache.hits == 1 and again == first
    assert engine.stats.spec.num_accepted_tokens == engine.stats.spec.num_draft_tokens > 0
    assert_pool_free(engine)


def test_draft_model_is_checked(hf_models, cache_dir):
    with pytest.raises(ValueError, match="speculative_config.model: .*recurrent layers"):
        make_engine(hf_models["qwen2"][1], cache_dir,
                    {"method": "draft_model", "model": str(hf_models["qwen3_5"][1]), "num_speculative_tokens": 2})


# ---- MTP ----
def add_mtp_head(path, seed: int = 0) -> None:
    """mtp.* tensors as a Qwen3.5-family checkpoint carries them: one full-attention layer (the
    model's last layer, which is one, perturbed: dense or experts as the model's MLPs are), fc and
    its norms random; and mtp_num_hidden_layers in the config."""
    from safetensors.torch import load_file, save_file

    cfg = json.loads((path / "config.json").read_text())
    hidden = cfg["hidden_size"]
    gen = torch.Generator().manual_seed(seed)
    shard = path / "model.safetensors"
    state = load_file(shard)
    last = f"model.layers.{cfg['num_hidden_layers'] - 1}."
    assert cfg["layer_types"][-1] == "full_attention"
    tensors = {"mtp.layers.0." + k[len(last):]: v + torch.randn(v.shape, generator=gen) * 0.05
               for k, v in state.items() if k.startswith(last)}
    tensors["mtp.fc.weight"] = torch.randn(hidden, 2 * hidden, generator=gen) * 0.08
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        tensors[f"mtp.{name}.weight"] = torch.randn(hidden, generator=gen) * 0.3
    state.update(tensors)
    save_file(state, shard, metadata={"format": "pt"})
    cfg["mtp_num_hidden_layers"] = 1
    (path / "config.json").write_text(json.dumps(cfg))


def with_mtp(hf_models, tmp_path_factory, family: str):
    import shutil

    model, src = hf_models[family]
    path = tmp_path_factory.mktemp("mtp") / family
    shutil.copytree(src, path)
    add_mtp_head(path)
    return model, path


@pytest.fixture(scope="module")
def qwen3_5_with_mtp(hf_models, tmp_path_factory):
    return with_mtp(hf_models, tmp_path_factory, "qwen3_5")


def reference_mtp(model, path, hidden: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    """The MTP head in transformers' pieces: its layer is a Qwen3.5 full-attention decoder layer
    (a one-layer Qwen3_5TextModel, whose final norm is mtp.norm), fed fc([norm(embedding) |
    norm(hidden)]); logits by the target's lm_head. ``hidden[p]`` and ``tokens[p]`` (token p + 1)
    make entry p."""
    import transformers
    from safetensors.torch import load_file

    state = load_file(path / "model.safetensors")
    cfg = transformers.Qwen3_5TextConfig(**{**json.loads((path / "config.json").read_text()), "num_hidden_layers": 1,
                                            "layer_types": ["full_attention"]})
    cfg._attn_implementation = "eager"
    layer_model = transformers.models.qwen3_5.modeling_qwen3_5.Qwen3_5TextModel(cfg).eval()
    layer_model.load_state_dict({k[len("mtp."):]: v for k, v in state.items()
                                 if k.startswith("mtp.layers.") or k == "mtp.norm.weight"}, strict=False)
    norm = transformers.models.qwen3_5.modeling_qwen3_5.Qwen3_5RMSNorm
    pre_e, pre_h = norm(cfg.hidden_size, cfg.rms_norm_eps), norm(cfg.hidden_size, cfg.rms_norm_eps)
    pre_e.weight.data.copy_(state["mtp.pre_fc_norm_embedding.weight"])
    pre_h.weight.data.copy_(state["mtp.pre_fc_norm_hidden.weight"])
    with torch.no_grad():
        embeds = model.get_input_embeddings()(torch.tensor([tokens]))
        x = torch.cat([pre_e(embeds), pre_h(hidden.unsqueeze(0))], dim=-1) @ state["mtp.fc.weight"].T
        out = layer_model(inputs_embeds=x).last_hidden_state[0]
    return out


def test_mtp_proposals_match_a_transformers_reference(qwen3_5_with_mtp, cache_dir):
    """After a prompt's prefill, the two proposals are the reference head's argmax at the last
    position, then at the next one fed its own output and the first proposal."""
    model, path = qwen3_5_with_mtp
    prompt = looping_prompts(1, seed=9)[0][:12]
    with torch.no_grad():
        target = model.model(input_ids=torch.tensor([prompt])).last_hidden_state[0]
        first = int(model.lm_head(target[-1]).argmax())
    out = reference_mtp(model, path, target, prompt[1:] + [first])
    d0 = int(model.lm_head(out[-1]).argmax())
    out2 = reference_mtp(model, path, torch.cat([target, out[-1:]]), prompt[1:] + [first, d0])
    d1 = int(model.lm_head(out2[-1]).argmax())
    engine = make_engine(path, cache_dir, {"method": "mtp", "num_speculative_tokens": 2})
    engine.add_request("r", prompt, greedy(8))
    engine.step()
    req = engine.scheduler.running[0]
    assert req.output_token_ids == [first]
    assert req.spec_token_ids == [d0, d1]


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def test_mtp_outputs_equal_plain_decoding(hf_models, tmp_path_factory, cache_dir, family):
    _, path = with_mtp(hf_models, tmp_path_factory, family)
    requests = pressure_workload()
    plain = drain(make_engine(path, cache_dir, **PRESSURE), requests)
    engine = make_engine(path, cache_dir, {"method": "mtp", "num_speculative_tokens": 2}, **PRESSURE)
    got = drain(engine, requests)
    for rid, _, _ in requests:
        assert got[rid].outputs[0].token_ids == plain[rid].outputs[0].token_ids, rid
    assert engine.stats.spec.num_drafts > 10
    assert engine.scheduler.num_preemptions > 0 and engine.kv.prefix_cache_hits > 0
    assert_pool_free(engine)


def test_mtp_needs_the_head(hf_models, cache_dir):
    with pytest.raises(ValueError, match="speculative_config.method: mtp needs"):
        make_engine(hf_models["qwen3_5"][1], cache_dir, {"method": "mtp", "num_speculative_tokens": 2})


# ---- over HTTP ----
def test_server_speculates_counts_and_lets_a_request_opt_out(qwen2_dir, cache_dir, tmp_path):
    """`anna serve --speculative-config`: the same completion with and without the request's opt-out,
    vLLM's counters on /metrics (which `anna bench` reads), and a bad config refused at start."""
    import asyncio
    import subprocess
    import sys

    import httpx

    from anna.bench.client import BenchClient, counter_deltas
    from conftest import launch_server, stop_server

    proc, base = launch_server(qwen2_dir, cache_dir, tmp_path / "server.log", "--speculative-config", json.dumps(NGRAM),
                               "--no-inference-warmup")
    try:
        client = BenchClient(base, str(qwen2_dir))
        before = asyncio.run(client.counters())
        body = {"model": str(qwen2_dir), "prompt": looping_prompts(1)[0], "max_tokens": 40, "temperature": 0,
                "ignore_eos": True}
        plain = httpx.post(base + "/v1/completions", json={**body, "speculative": False}, timeout=60).json()
        spec = httpx.post(base + "/v1/completions", json=body, timeout=60).json()
        assert spec["choices"][0]["text"] == plain["choices"][0]["text"]
        after = asyncio.run(BenchClient(base, str(qwen2_dir)).counters())
        delta = counter_deltas(before, after)["spec_decode"]
        assert delta["drafts"] > 0 and 0 < delta["accepted_tokens"] <= delta["draft_tokens"]
        assert delta["acceptance_rate"] == delta["accepted_tokens"] / delta["draft_tokens"]
        metrics = httpx.get(base + "/metrics").text
        assert 'anna:spec_decode_num_accepted_tokens_per_pos_total{model_name=' in metrics
        bad = httpx.post(base + "/v1/completions", json={**body, "speculative": "maybe"}, timeout=60)
        assert bad.status_code == 400
    finally:
        assert stop_server(proc) == 0
    refused = subprocess.run([sys.executable, "-m", "anna.cli.main", "serve", str(qwen2_dir), "--device", "cpu",
                              "--speculative-config", '{"method": "ngram"}'], capture_output=True, text=True,
                             timeout=120)
    assert refused.returncode != 0 and "speculative_config.num_speculative_tokens" in refused.stderr
