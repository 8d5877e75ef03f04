"""Sampling parameters, stopping, logprobs and the library API's validation."""

from __future__ import annotations

import pytest
import torch

from anna import LLM, SamplingParams
from conftest import ARCH_CONFIGS
from helpers import hf_logits

PROMPT = [(i * 13 + 5) % 700 + 3 for i in range(20)]


@pytest.fixture(scope="module")
def llm(qwen2_dir, cache_dir):
    return LLM(str(qwen2_dir), dtype="float32", device="cpu", cache_dir=str(cache_dir), max_model_len=512,
               num_gpu_blocks_override=128)


def gen(llm, prompts, params):
    return llm.generate(prompts, params, use_tqdm=False)


def test_same_seed_same_tokens_regardless_of_batch(llm):
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=24, ignore_eos=True)
    alone = gen(llm, [PROMPT], p)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True)
    batched = gen(llm, [PROMPT[:7], PROMPT, PROMPT[3:]], [others, p, others])[1].outputs[0].token_ids
    assert alone == batched
    other_seed = gen(llm, [PROMPT], SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=24,
                                                   ignore_eos=True))[0].outputs[0].token_ids
    assert other_seed != alone


def test_top_k_1_is_greedy(llm):
    greedy = gen(llm, [PROMPT], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    top1 = gen(llm, [PROMPT], SamplingParams(temperature=0.8, top_k=1, max_tokens=10, ignore_eos=True, seed=5))
    assert greedy[0].outputs[0].token_ids == top1[0].outputs[0].token_ids


def test_logit_bias_forces_a_token(llm):
    out = gen(llm, [PROMPT], SamplingParams(temperature=0.7, seed=1, max_tokens=6, ignore_eos=True,
                                            logit_bias={321: 100}))
    assert out[0].outputs[0].token_ids == [321] * 6


def test_allowed_token_ids_restrict_sampling(llm, hf_models):
    allowed = [5, 77, 300, 412]
    sampled = gen(llm, [PROMPT], SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True,
                                                allowed_token_ids=allowed))[0].outputs[0].token_ids
    assert len(sampled) == 12 and set(sampled) <= set(allowed) and len(set(sampled)) > 1
    first = gen(llm, [PROMPT], SamplingParams(temperature=0, max_tokens=1, allowed_token_ids=allowed))
    ref = hf_logits(hf_models["qwen2"][0], PROMPT)[-1]
    assert first[0].outputs[0].token_ids == [allowed[int(ref[allowed].argmax())]]
    eos = sorted(llm.llm_engine.eos_token_ids)[0]  # only EOS allowed while min_tokens bans it: EOS, no crash
    out = gen(llm, [PROMPT], SamplingParams(max_tokens=4, min_tokens=3, allowed_token_ids=[eos]))[0].outputs[0]
    assert out.token_ids == [eos] * 3 and out.finish_reason == "stop"  # EOS ends it once min_tokens is met
    with pytest.raises(ValueError, match="^allowed_token_ids: token id 900 is outside"):
        gen(llm, [PROMPT], SamplingParams(allowed_token_ids=[5, 900]))
    with pytest.raises(ValueError, match="^allowed_token_ids: must be"):
        SamplingParams(allowed_token_ids=[])


def test_min_p_and_top_p_keep_only_the_top_token_when_tight(llm):
    greedy = gen(llm, [PROMPT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].outputs[0].token_ids
    tight = gen(llm, [PROMPT], SamplingParams(temperature=1.0, top_p=1e-6, max_tokens=8, ignore_eos=True,
                                              seed=3))[0].outputs[0].token_ids
    assert tight == greedy
    minp = gen(llm, [PROMPT], SamplingParams(temperature=1.0, min_p=1.0, max_tokens=8, ignore_eos=True,
                                             seed=3))[0].outputs[0].token_ids
    assert minp == greedy


def test_repetition_penalty_changes_greedy_choice(llm):
    base = gen(llm, [PROMPT], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0].outputs[0].token_ids
    pen = gen(llm, [PROMPT], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                            frequency_penalty=2.0, presence_penalty=2.0,
                                            repetition_penalty=2.0))[0].outputs[0].token_ids
    assert pen != base
    # with strong penalties no output token repeats more often than without
    assert max(pen.count(t) for t in pen) <= max(base.count(t) for t in base)


def test_logprobs_match_transformers(llm, hf_models):
    model, _ = hf_models["qwen2"]
    out = gen(llm, [PROMPT], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=5))[0].outputs[0]
    ref = torch.log_softmax(hf_logits(model, PROMPT + out.token_ids[:-1])[len(PROMPT) - 1:], dim=-1)
    for step, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        assert len(entry) == 5
        assert entry[token].rank == 1  # greedy picks the top token
        top = torch.topk(ref[step], 5)
        assert list(entry) == top.indices.tolist()
        for tid, lp in entry.items():
            assert abs(lp.logprob - ref[step, tid].item()) < 1e-4


def test_stop_token_ids_and_eos(llm):
    greedy = gen(llm, [PROMPT], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0]
    stop_tok = greedy.token_ids[5]
    first = greedy.token_ids.index(stop_tok)
    out = gen(llm, [PROMPT], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_tok]))[0].outputs[0]
    assert out.token_ids == greedy.token_ids[:first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    # min_tokens keeps a stop token from ending the output early
    late = gen(llm, [PROMPT], SamplingParams(temperature=0, max_tokens=12, min_tokens=12,
                                             stop_token_ids=[stop_tok]))[0].outputs[0]
    assert len(late.token_ids) == 12 and late.finish_reason == "length"


def test_eos_from_generation_config_ends_output(llm):
    eos = next(iter(llm.llm_engine.eos_token_ids))
    out = gen(llm, [PROMPT], SamplingParams(temperature=0.5, seed=0, max_tokens=10, logit_bias={eos: 100}))
    assert out[0].outputs[0].token_ids == [eos] and out[0].outputs[0].finish_reason == "stop"
    assert out[0].outputs[0].text == ""
    ignored = gen(llm, [PROMPT], SamplingParams(temperature=0.5, seed=0, max_tokens=4, ignore_eos=True,
                                                logit_bias={eos: 100}))
    assert ignored[0].outputs[0].token_ids == [eos] * 4


def test_stop_string_across_token_boundaries(llm):
    tok = llm.get_tokenizer()
    greedy = gen(llm, [PROMPT], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0].outputs[0]
    text = greedy.text
    # a stop string made of the end of one token's text and the start of a later one
    pieces = [tok.decode([t]) for t in greedy.token_ids]
    boundary = len(pieces[2]) + len(pieces[3])
    start = len(pieces[0]) + len(pieces[1]) + max(0, len(pieces[2]) - 1)
    stop = text[start:start + 3] if len(text) > start + 3 else text[-3:]
    assert len(stop) == 3 and boundary > 0
    out = gen(llm, [PROMPT], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[:text.find(stop)]
    incl = gen(llm, [PROMPT], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=stop,
                                             include_stop_str_in_output=True))[0].outputs[0]
    assert incl.text == text[:text.find(stop) + len(stop)]


def test_n_samples_share_the_prompt(llm):
    out = gen(llm, [PROMPT], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True))[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    assert llm.llm_engine.kv.num_free_blocks == llm.llm_engine.kv.num_blocks


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"), (dict(min_p=2), "min_p"), (dict(max_tokens=0), "max_tokens"),
    (dict(n=0), "n"), (dict(presence_penalty=3), "presence_penalty"), (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(logprobs=21), "logprobs"), (dict(stop=[""]), "stop"), (dict(min_tokens=5, max_tokens=2), "min_tokens"),
    (dict(logit_bias={"x": 1}), "logit_bias"), (dict(seed="a"), "seed"), (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(frequency_penalty="1"), "frequency_penalty"),
])
def test_invalid_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        SamplingParams(**kwargs)


def test_request_errors_name_the_field(llm):
    with pytest.raises(ValueError, match="^max_tokens:.*more than max_model_len=512"):
        gen(llm, [PROMPT], SamplingParams(max_tokens=500))
    for length in (512, 700):  # no room left for a token, whether or not max_tokens is given
        for params in (SamplingParams(), SamplingParams(max_tokens=1)):
            with pytest.raises(ValueError, match=f"^prompt: the prompt has {length} tokens;.*at most 511"):
                gen(llm, [[5] * length], params)
    with pytest.raises(ValueError, match="^logit_bias: token id 900 is outside"):
        gen(llm, [PROMPT], SamplingParams(logit_bias={5: 1.0, 900: 2.0}))
    with pytest.raises(ValueError, match="^prompt: token id 900"):
        gen(llm, [[1, 2, 900]], SamplingParams())
    with pytest.raises(ValueError, match="^prompt: must not be empty"):
        gen(llm, [[]], SamplingParams())
    with pytest.raises(ValueError, match="^sampling_params:"):
        gen(llm, [PROMPT, PROMPT], [SamplingParams()])
    for prompts in (None, 5):
        with pytest.raises(ValueError, match="^prompts: must be"):
            llm.generate(prompts, SamplingParams(max_tokens=1), use_tqdm=False)
    for messages in ("hi", [], ["hi"], [[{"role": "user", "content": "x"}], "hi"]):
        with pytest.raises(ValueError, match="^messages: must be"):
            llm.chat(messages, SamplingParams(max_tokens=1), use_tqdm=False)
    assert llm.llm_engine.kv.num_free_blocks == llm.llm_engine.kv.num_blocks
    assert not llm.llm_engine.has_unfinished_requests()


def test_invalid_settings_name_the_field(qwen2_dir):
    with pytest.raises(ValueError, match="^max_num_seqz: not a setting"):
        LLM(str(qwen2_dir), max_num_seqz=4)
    with pytest.raises(ValueError, match="^dtype: 'float8'"):
        LLM(str(qwen2_dir), dtype="float8")
    with pytest.raises(ValueError, match="^max_num_seqs: 'many'"):
        LLM(str(qwen2_dir), max_num_seqs="many")


def test_chat_uses_the_template(llm):
    tok = llm.get_tokenizer()
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    out = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
    expected = tok.encode("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                          "<|im_start|>assistant\n", add_special_tokens=False)
    assert out.prompt_token_ids == expected
    other = [{"role": "user", "content": "Bye"}]
    both = llm.chat([msgs, other], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert both[0].prompt_token_ids == expected and both[0].outputs[0].token_ids == out.outputs[0].token_ids
    alone = llm.chat(other, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
    assert both[1].prompt_token_ids == alone.prompt_token_ids != expected


def test_chat_template_setting_replaces_the_tokenizers(qwen2_dir, cache_dir, tmp_path):
    import asyncio

    import httpx

    from anna.server.app import create_app
    from conftest import engine_settings

    template = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}[assistant] {% endif %}")
    (tmp_path / "t.jinja").write_text(template)
    messages = [{"role": "user", "content": "Hi"}]
    for value in (str(tmp_path / "t.jinja"), template):
        llm = LLM(str(qwen2_dir), chat_template=value, dtype="float32", device="cpu", cache_dir=str(cache_dir),
                  max_model_len=512, num_gpu_blocks_override=32)
        out = llm.chat(messages, SamplingParams(max_tokens=1), use_tqdm=False)[0]
        expected = llm.get_tokenizer().encode("[user] Hi\n[assistant] ", add_special_tokens=False)
        assert out.prompt_token_ids == expected
    app = create_app(engine_settings(qwen2_dir, cache_dir, chat_template=template, inference_warmup=False),
                     load_in_background=False)

    async def tokenize():
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
                return (await client.post("/tokenize", json={"messages": messages})).json()

    assert asyncio.run(tokenize())["tokens"] == expected
    for value, message in (("nope.jinja", "is neither a file nor a Jinja template"),
                           ("{% for %}", "chat template does not compile")):
        with pytest.raises(ValueError, match=f"^chat_template: .*{message}"):
            LLM(str(qwen2_dir), chat_template=value, dtype="float32", device="cpu", cache_dir=str(cache_dir))


@pytest.mark.parametrize("arch", ["qwen2", "llama3"])
def test_bfloat16_logits_close_to_transformers(arch, hf_models, cache_dir):
    """bf16 exercises the CPU matmul routing (prefill upcasts, decode stays bf16)."""
    from anna.runtime.engine import LLMEngine
    from conftest import engine_settings
    from helpers import run_logits

    model, path = hf_models[arch]
    engine = LLMEngine(engine_settings(path, cache_dir, dtype="bfloat16"), show_progress=False)
    logits, tokens = run_logits(engine, PROMPT, 4)
    ref = hf_logits(model, PROMPT + tokens[:-1])
    err = (logits - ref).abs().max() / ref.abs().max()
    assert err < 3e-2, f"bf16 relative logit error {err:.3e}"
    assert ARCH_CONFIGS  # the fixture models are float32; bf16 rounding bounds the error


def test_truncate_prompt_tokens_keeps_the_end_of_the_prompt(llm):
    long = [(i * 11 + 3) % 700 + 3 for i in range(100)]
    params = dict(temperature=0, max_tokens=6, ignore_eos=True)
    cut = gen(llm, [long], SamplingParams(truncate_prompt_tokens=20, **params))[0]
    direct = gen(llm, [long[-20:]], SamplingParams(**params))[0]
    assert cut.prompt_token_ids == long[-20:] and cut.outputs[0].token_ids == direct.outputs[0].token_ids
    assert gen(llm, [long[:10]], SamplingParams(truncate_prompt_tokens=20, **params))[0].prompt_token_ids == long[:10]
    over = [5] * 600  # longer than max_model_len=512, but only its last 100 tokens are kept
    assert len(gen(llm, [over], SamplingParams(truncate_prompt_tokens=100, **params))[0].prompt_token_ids) == 100
    with pytest.raises(ValueError, match="^truncate_prompt_tokens: must be"):
        SamplingParams(truncate_prompt_tokens=0)


def contains(seq: list[int], part: list[int]) -> bool:
    return any(seq[i:i + len(part)] == part for i in range(len(seq) - len(part) + 1))


def test_bad_words_are_never_generated(llm):
    engine, tok = llm.llm_engine, llm.get_tokenizer()
    params = dict(temperature=0, max_tokens=24, ignore_eos=True)
    free = gen(llm, [PROMPT], SamplingParams(**params))[0].outputs[0].token_ids
    # words the free run produced: one token that reads back as itself, and a two-token stretch
    one = next(tok.decode([t]) for t in free if tok.encode(tok.decode([t]), add_special_tokens=False) == [t])
    two = next(tok.decode(free[i:i + 2]) for i in range(len(free) - 1)
               if len(tok.encode(tok.decode(free[i:i + 2]), add_special_tokens=False)) == 2
               and tok.encode(tok.decode(free[i:i + 2]), add_special_tokens=False) == free[i:i + 2])
    banned = engine.inputs.bad_word_ids([one, two])
    assert any(contains(free, seq) for seq in banned)  # the free run does produce them
    out = gen(llm, [PROMPT], SamplingParams(bad_words=[one, two], **params))[0].outputs[0].token_ids
    assert len(out) == 24 and not any(contains(out, seq) for seq in banned)
    with pytest.raises(ValueError, match="^bad_words: must be"):
        SamplingParams(bad_words=["ok", " "])


def test_batched_sampling_gives_each_row_what_it_gets_alone():
    """The sampler runs penalties, temperature, top-k, top-p and min-p as batched ops over the rows
    that use them: a seeded or greedy row must get the token (and logprobs) it gets sampled alone."""
    import torch

    from anna.core.request import Request
    from anna.runtime.sampler import Sampler

    mixes = [dict(temperature=0.0), dict(temperature=0.8, top_p=0.9, top_k=50, seed=1),
             dict(temperature=0.7, top_p=0.5, seed=2), dict(temperature=0.9, min_p=0.05, seed=3),
             dict(temperature=0.0, repetition_penalty=1.3),
             dict(temperature=0.8, top_p=0.9, repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.3,
                  seed=4),
             dict(temperature=1.0, top_k=7, logit_bias={5: 30.0}, seed=5),
             dict(temperature=1.0, allowed_token_ids=[3, 9, 11], seed=6),
             dict(temperature=0.6, min_tokens=5, stop_token_ids=[1, 2], seed=7), dict(temperature=0.5, logprobs=3, seed=8)]

    def requests() -> list[Request]:
        reqs = []
        for i, kw in enumerate(mixes):
            r = Request(f"r{i}", list(range(3, 40)), SamplingParams(max_tokens=64, **kw), eos_token_ids=frozenset([0]))
            for j in range(4):
                r.append_output_token((i * 13 + j * 7) % 500)
            reqs.append(r)
        return reqs

    logits = torch.randn(len(mixes), 500, generator=torch.Generator().manual_seed(0)) * 4
    batch = Sampler(0, torch.device("cpu"))(logits, requests())
    for i, req in enumerate(requests()):
        alone = Sampler(0, torch.device("cpu"))(logits[i:i + 1], [req])
        assert alone.tokens.tolist() == [batch.tokens[i].item()], mixes[i]
        assert alone.logprobs[0] == batch.logprobs[i]
    assert not batch.failed
