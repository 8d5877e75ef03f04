"""Constrained decoding in the library: a random-weight model writes garbage on its own, so every
output that parses and validates here does so because of the token masks."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from anna import LLM, SamplingParams, StructuredOutputsParams
from anna.runtime.structured_output import apply_grammar_masks

PROMPT = [(i * 7 + 3) % 700 + 3 for i in range(12)]
SEEDS = range(12)
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "member": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "address": {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "member", "tags", "address"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm(qwen2_dir, cache_dir):
    return LLM(str(qwen2_dir), dtype="float32", device="cpu", cache_dir=str(cache_dir), max_model_len=512,
               num_gpu_blocks_override=128)


def sample(llm, spec, seeds=SEEDS, max_tokens=200, **kw):
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=max_tokens, structured_outputs=spec, **kw)
              for s in seeds]
    return [o.outputs[0] for o in llm.generate([PROMPT] * len(params), params, use_tqdm=False)]


def test_free_output_is_not_json(llm):
    """The baseline the constraints are measured against: unconstrained, the model writes no JSON."""
    for out in sample(llm, None, max_tokens=40, ignore_eos=True):
        with pytest.raises(json.JSONDecodeError):
            json.loads(out.text)


def test_json_schema_outputs_validate_for_every_seed(llm):
    outs = sample(llm, StructuredOutputsParams(json=PERSON))
    for out in outs:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), PERSON)
    assert len({o.text for o in outs}) > len(outs) // 2  # constrained, yet still sampled


def test_json_schema_given_as_text(llm):
    out = sample(llm, StructuredOutputsParams(json=json.dumps(PERSON)), seeds=[3])[0]
    jsonschema.validate(json.loads(out.text), PERSON)


def test_json_object_outputs_parse_when_finished(llm):
    outs = sample(llm, StructuredOutputsParams(json_object=True), max_tokens=120)
    finished = [o for o in outs if o.finish_reason == "stop"]
    assert finished
    for out in finished:
        assert isinstance(json.loads(out.text), dict)
    for out in outs:  # cut by max_tokens: still a prefix of an object
        assert out.text.startswith("{")


def test_regex_outputs_match(llm):
    pattern = r"[a-z]{2,6}@[a-z]{2,6}\.(com|org)"
    for out in sample(llm, StructuredOutputsParams(regex=pattern)):
        assert out.finish_reason == "stop"
        assert re.fullmatch(pattern, out.text), out.text


def test_choice_outputs_are_choices(llm):
    choices = ["yes", "no", "it depends"]
    outs = sample(llm, StructuredOutputsParams(choice=choices))
    assert all(o.text in choices for o in outs)
    greedy = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=20,
                                                   structured_outputs=StructuredOutputsParams(choice=choices)),
                          use_tqdm=False)[0].outputs[0]
    assert greedy.text in choices


def test_lark_grammar(llm):
    grammar = 'start: "(" expr ")"\nexpr: NUM | NUM "+" NUM\nNUM: /[1-9][0-9]?/\n'
    for out in sample(llm, StructuredOutputsParams(grammar=grammar)):
        assert re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)?\)", out.text), out.text


def test_constrained_and_free_requests_share_a_batch(llm):
    free = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    alone = llm.generate([PROMPT], free, use_tqdm=False)[0].outputs[0].token_ids
    constrained = SamplingParams(temperature=1.0, seed=7, max_tokens=200, structured_outputs=StructuredOutputsParams(json=PERSON))
    outs = llm.generate([PROMPT, PROMPT[2:]], [free, constrained], use_tqdm=False)
    assert outs[0].outputs[0].token_ids == alone
    jsonschema.validate(json.loads(outs[1].outputs[0].text), PERSON)


def test_n_samples_each_follow_the_grammar(llm):
    p = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=200, structured_outputs=StructuredOutputsParams(json=PERSON))
    out = llm.generate([PROMPT], p, use_tqdm=False)[0]
    assert len(out.outputs) == 3
    for o in out.outputs:
        jsonschema.validate(json.loads(o.text), PERSON)
    engine = llm.llm_engine
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_greedy_constrained_takes_the_best_allowed_token(llm, hf_models):
    """Greedy under a choice constraint picks the allowed first token the model itself likes best."""
    from helpers import hf_logits

    choices = ["yes", "no", "maybe"]
    tok = llm.get_tokenizer()
    first_ids = {tok.encode(c, add_special_tokens=False)[0] for c in choices}
    logits = hf_logits(hf_models["qwen2"][0], PROMPT)[-1]
    best = max(first_ids, key=lambda t: float(logits[t]))
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=10,
                                                structured_outputs=StructuredOutputsParams(choice=choices)),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids[0] == best


def test_apply_grammar_masks_allows_exactly_the_grammar(llm):
    engine = llm.llm_engine
    matcher = engine.structured.new_matcher(StructuredOutputsParams(regex="[0-9]+"))
    logits = torch.zeros(3, engine.model_config.vocab_size)
    apply_grammar_masks(logits, [1], [matcher])
    assert torch.isfinite(logits[0]).all() and torch.isfinite(logits[2]).all()
    allowed = torch.isfinite(logits[1]).nonzero().flatten().tolist()
    tok = llm.get_tokenizer()
    assert allowed and all(re.fullmatch("[0-9]+", tok.decode([t])) for t in allowed)
    digits = [t for t in range(tok.vocab_size) if re.fullmatch("[0-9]+", tok.decode([t]) or "x")]
    assert set(digits) <= set(allowed)


@pytest.mark.parametrize("spec, message", [
    (dict(json={"type": "objekt"}), "structured_outputs: invalid json"),
    (dict(json={"type": "string", "pattern": "(("}), "structured_outputs: invalid json"),
    (dict(regex="a(b"), "structured_outputs: invalid regex"),
    (dict(grammar="start: undefined_rule\n"), "structured_outputs: invalid grammar"),
    (dict(json={"type": "string", "enum": ["x" * 70000]}), "bytes, more than"),
])
def test_invalid_constraints_are_value_errors(llm, spec, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        llm.generate([PROMPT], SamplingParams(structured_outputs=StructuredOutputsParams(**spec)), use_tqdm=False)
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


@pytest.mark.parametrize("kwargs, message", [
    (dict(), "set exactly one"),
    (dict(json={"type": "object"}, regex="x"), "set exactly one"),
    (dict(json="{not json"), "structured_outputs.json: not valid JSON"),
    (dict(json=[1, 2]), "structured_outputs.json: a JSON schema must be an object"),
    (dict(choice=[]), "structured_outputs.choice"),
    (dict(regex=5), "structured_outputs.regex"),
])
def test_structured_outputs_params_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        StructuredOutputsParams(**kwargs)


def test_pathological_regex_is_bounded(llm):
    """A regex built to explode the lexer either compiles within llguidance's fuel or is refused;
    either way the engine still serves the next request."""
    try:
        sample(llm, StructuredOutputsParams(regex="(a{1000}){1000}"), seeds=[0], max_tokens=4)
    except ValueError as exc:
        assert "structured_outputs" in str(exc)
    out = sample(llm, StructuredOutputsParams(choice=["ok"]), seeds=[0])[0]
    assert out.text == "ok"


def test_compiled_grammars_are_cached_and_bounded(llm):
    compiler = llm.llm_engine.structured
    spec = StructuredOutputsParams(regex="[a-c]{3}")
    assert compiler.compile(spec) is compiler.compile(StructuredOutputsParams(regex="[a-c]{3}"))
    for i in range(compiler.cache_size + 5):
        compiler.compile(StructuredOutputsParams(regex=f"x{i}"))
    assert len(compiler._cache) == compiler.cache_size


def test_grammar_wins_over_min_tokens_when_only_eos_is_left(llm):
    """An empty regex allows only the end at once, while min_tokens bans EOS: the grammar's end is
    honoured instead of sampling from no allowed token at all (which would crash multinomial)."""
    outs = sample(llm, StructuredOutputsParams(regex=""), seeds=range(3), min_tokens=4, max_tokens=8)
    assert all(o.text == "" and o.finish_reason == "stop" and len(o.token_ids) == 1 for o in outs)
    assert all(o.token_ids[0] in llm.llm_engine.eos_token_ids for o in outs)


def test_constrained_requests_survive_preemption(qwen2_dir, cache_dir):
    """With a KV pool too small for all of them, requests are preempted and recomputed; their
    grammars follow the tokens they keep, and every output still validates."""
    small = LLM(str(qwen2_dir), dtype="float32", device="cpu", cache_dir=str(cache_dir), max_model_len=256,
                num_gpu_blocks_override=16)
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=150, structured_outputs=StructuredOutputsParams(json=PERSON))
              for s in range(6)]
    outs = small.generate([PROMPT * 3] * 6, params, use_tqdm=False)
    assert small.llm_engine.scheduler.num_preemptions > 0
    for o in outs:
        jsonschema.validate(json.loads(o.outputs[0].text), PERSON)


def test_constraints_after_a_reasoning_block(llm):
    """With a reasoning parser the answer is constrained after an optional <think> block."""
    from anna.server.constraints import after_reasoning
    from anna.server.tool_parsers import HermesToolParser

    compiler, tok = llm.llm_engine.structured, llm.get_tokenizer()

    def accepts(spec, text: str) -> bool:
        matcher = compiler.new_matcher(spec)
        return matcher.consume_tokens(tok.encode(text, add_special_tokens=False)) and matcher.is_accepting()

    answer = '{"name": "Ada", "age": 36, "member": true, "tags": ["red"], "address": {"zip": "12345"}}'
    spec = after_reasoning(StructuredOutputsParams(json=PERSON))
    assert accepts(spec, "<think>\nfirst the name, then </ the rest\n</think>\n\n" + answer)
    assert accepts(spec, answer)
    assert not accepts(spec, "<think>plan</think>\nno JSON here")
    assert not accepts(spec, "plain text")
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    calls = after_reasoning(StructuredOutputsParams(grammar=HermesToolParser.grammar(tools, parallel=False)))
    call = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    assert accepts(calls, "<think>which tool?</think>\n" + call) and accepts(calls, call)
    assert not accepts(calls, "<think>which tool?</think>\nnone")
    regex = StructuredOutputsParams(regex="[0-9]+")
    assert after_reasoning(regex) is regex
