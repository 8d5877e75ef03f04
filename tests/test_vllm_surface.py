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


def test_beam_search_matches_transformers_num_beams(hf_models, qwen2_dir, cache_dir):
    """LLM.beam_search against transformers' generate(num_beams=...) on the same weights: the same
    beams in the same order, with the same summed logprobs (length_penalty 0 there: its score is
    the sum). None of the beams meets EOS here, where the two rank finished beams differently."""
    import torch

    from anna import BeamSearchParams

    hf, _ = hf_models["qwen2"]
    llm = LLM(str(qwen2_dir), dtype="float32", device="cpu", cache_dir=str(cache_dir), max_model_len=256,
              num_gpu_blocks_override=128, block_size=16)
    eos = llm.llm_engine.inputs.eos_token_ids
    for prompt, width, steps in (([5, 17, 42, 99, 3, 250, 7], 3, 8), (list(range(30, 50)), 4, 6)):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), num_beams=width, num_return_sequences=width, do_sample=False,
                              max_new_tokens=steps, length_penalty=0.0, early_stopping=False,
                              output_scores=True, return_dict_in_generate=True, pad_token_id=0)
        ref_beams = [row[len(prompt):].tolist() for row in ref.sequences]
        assert not any(t in eos for beam in ref_beams for t in beam)  # the premise above
        kv = llm.llm_engine.kv
        hits = kv.prefix_cache_hits
        (out,) = llm.beam_search([{"prompt_token_ids": prompt}], BeamSearchParams(beam_width=width, max_tokens=steps,
                                                                                 length_penalty=0.0))
        # every step after the first finds each beam's full blocks (here the prompt's first 16) cached
        assert kv.prefix_cache_hits - hits >= 16 * (len(prompt) // 16) * width * (steps - 1)
        assert [s.tokens[len(prompt):] for s in out.sequences] == ref_beams
        assert [s.tokens[:len(prompt)] for s in out.sequences] == [prompt] * width
        for seq, score in zip(out.sequences, ref.sequences_scores.tolist()):
            assert math.isclose(seq.cum_logprob, score, abs_tol=2e-3)
            assert seq.finish_reason == "length" and len(seq.logprobs) == steps
            assert seq.text == llm.get_tokenizer().decode(seq.tokens[len(prompt):])
    assert llm.llm_engine.kv.num_free_blocks == llm.llm_engine.kv.num_blocks  # every step's blocks came back


def test_beam_search_ends_beams_at_eos_and_checks_its_params(llm):
    from anna import BeamSearchParams

    out = llm.beam_search(["Hello there", "Bye"], BeamSearchParams(beam_width=2, max_tokens=4))
    assert len(out) == 2 and all(len(o.sequences) == 2 for o in out)
    scores = [s.cum_logprob / len(s.tokens) for s in out[0].sequences]
    assert scores == sorted(scores, reverse=True)  # best first, by length-normalised logprob
    eos = llm.llm_engine.inputs.eos_token_ids
    for o in out:
        for s in o.sequences:
            assert (s.finish_reason == "stop") == (s.tokens[-1] in eos)
    for field, value in (("beam_width", 0), ("beam_width", 11), ("max_tokens", 0), ("temperature", -1)):
        with pytest.raises(ValueError, match=f"^{field}:"):
            BeamSearchParams(**{"beam_width": 2, "max_tokens": 3, field: value})
    with pytest.raises(ValueError, match="^params:"):
        llm.beam_search(["x"], SamplingParams())


VLLM_SCRIPT = '''
from vllm import LLM, SamplingParams
from vllm.sampling_params import BeamSearchParams

prompts = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
]
sampling_params = SamplingParams(temperature=0.8, top_p=0.95)
llm = LLM(model=MODEL)
outputs = llm.generate(prompts, sampling_params)
for output in outputs:
    prompt = output.prompt
    generated_text = output.outputs[0].text
    print(f"Prompt: {prompt!r}, Generated text: {generated_text!r}")

sampling_params = llm.get_default_sampling_params()
sampling_params.max_tokens = 8
sampling_params.logprobs = 2
outputs = llm.generate(prompts, sampling_params)
for output in outputs:
    out = output.outputs[0]
    print("logprobs", len(out.logprobs) == len(out.token_ids) <= 8, out.cumulative_logprob is not None)

conversation = [
    {"role": "system", "content": "You are a helpful assistant"},
    {"role": "user", "content": "Hello"},
    {"role": "assistant", "content": "Hello! How can I assist you today?"},
    {"role": "user", "content": "Write an essay about the importance of higher education."},
]
outputs = llm.chat(conversation, SamplingParams(temperature=0.5, max_tokens=10), use_tqdm=False)
print("chat", outputs[0].prompt.endswith("<|im_start|>assistant\\n"), len(outputs[0].outputs[0].token_ids) <= 10)

params = BeamSearchParams(beam_width=3, max_tokens=5)
outputs = llm.beam_search([{"prompt": "Hello, my name is"}], params)
for output in outputs:
    print("beams", len(output.sequences), output.sequences[0].text is not None)
'''


def test_vllm_offline_examples_run_with_the_import_renamed(qwen2_dir, cache_dir, tmp_path):
    """vLLM's quickstart, its default-sampling-params and chat examples and its beam search
    usage, with `vllm` renamed `anna` in the imports and nothing else changed but the model."""
    import subprocess
    import sys

    script = tmp_path / "offline.py"
    script.write_text(f"MODEL = {str(qwen2_dir)!r}\n" + VLLM_SCRIPT.replace("from vllm", "from anna"))
    env = {**__import__("os").environ, "ANNA_CACHE_DIR": str(cache_dir), "ANNA_NUM_GPU_BLOCKS_OVERRIDE": "64"}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert sum(line.startswith("Prompt: 'The capital of France is', Generated text: ") for line in lines) == 1
    assert lines.count("logprobs True True") == 4
    assert "chat True True" in lines and "beams 3 True" in lines
