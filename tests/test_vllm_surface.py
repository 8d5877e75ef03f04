"""The parts of vLLM's library surface that scripts written for vLLM touch first."""

from __future__ import annotations

import math

import pytest

from anna import LLM, SamplingParams, TextPrompt, TokensPrompt


@pytest.fixture(scope="module")
def llm(qwen2_dir, cache_dir):
    return LLM(str(qwen2_dir), dtype="float32", device="cpu", cache_dir=str(cache_dir), max_model_len=256,
               num_gpu_blocks_override=64)


def test_vllm_import_paths_and_prompt_dicts(llm):
    import anna.sampling_params

    assert anna.sampling_params.SamplingParams is SamplingParams
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    ids = llm.get_tokenizer().encode("Hello there", add_special_tokens=False)
    by_text, by_ids = llm.generate([TextPrompt(prompt="Hello there"), TokensPrompt(prompt_token_ids=ids)], params,
                                   use_tqdm=False)
    assert by_text.prompt == "Hello there" and by_ids.prompt_token_ids == ids
    assert by_text.outputs[0].token_ids == by_ids.outputs[0].token_ids


def test_logprobs_fill_cumulative_logprob_and_decoded_tokens(llm):
    tok = llm.get_tokenizer()
    out = llm.generate(["a b c"], SamplingParams(temperature=0.8, seed=3, max_tokens=8, logprobs=2),
                       use_tqdm=False)[0].outputs[0]
    chosen = [entry[t].logprob for t, entry in zip(out.token_ids, out.logprobs)]
    assert math.isclose(out.cumulative_logprob, sum(chosen), rel_tol=1e-6, abs_tol=1e-6)
    for token, entry in zip(out.token_ids, out.logprobs):
        for token_id, lp in entry.items():
            assert lp.decoded_token == tok.decode([token_id], skip_special_tokens=False)
        assert entry[token].rank is not None and (entry[token].rank <= 2) == (len(entry) == 2)
    plain = llm.generate(["a b c"], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0]
    assert plain.cumulative_logprob is None and plain.logprobs is None


def test_chat_reports_the_rendered_prompt(llm):
    out = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert out.prompt is not None and "Hi" in out.prompt
    assert llm.get_tokenizer().encode(out.prompt, add_special_tokens=False) == out.prompt_token_ids


def test_vllm_sampling_params_names(llm):
    from anna.sampling_params import GuidedDecodingParams

    ids_only = llm.generate(["a b"], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, detokenize=False),
                            use_tqdm=False)[0].outputs[0]
    with_text = llm.generate(["a b"], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                             use_tqdm=False)[0].outputs[0]
    assert ids_only.text == "" and ids_only.token_ids == with_text.token_ids and with_text.text
    guided = SamplingParams(temperature=0, max_tokens=8, guided_decoding=GuidedDecodingParams(choice=["yes", "no"]))
    assert guided.structured_outputs is not None and guided.guided_decoding is None
    assert llm.generate(["q"], guided, use_tqdm=False)[0].outputs[0].text in ("yes", "no")
    assert SamplingParams(n=2, best_of=2).best_of == 2
    for kwargs, field in [(dict(n=1, best_of=3), "best_of"), (dict(spaces_between_special_tokens=False),
                                                               "spaces_between_special_tokens"),
                          (dict(detokenize=False, stop=["x"]), "detokenize"),
                          (dict(guided_decoding=GuidedDecodingParams(regex="a"),
                                structured_outputs=GuidedDecodingParams(regex="b")), "guided_decoding")]:
        with pytest.raises(ValueError, match=f"^{field}:"):
            SamplingParams(**kwargs)
