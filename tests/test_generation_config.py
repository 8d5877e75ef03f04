"""Default sampling parameters from the model's generation_config.json, as vLLM applies them:
for the fields a request leaves out, with max_new_tokens as a server-wide cap."""

from __future__ import annotations

import asyncio
import json
import shutil

import httpx
import pytest

from anna import LLM, SamplingParams
from anna.server.app import create_app

PROMPT = [5, 17, 99, 3, 250, 41]


@pytest.fixture(scope="module")
def model_with_defaults(qwen2_dir, tmp_path_factory):
    """The tiny Qwen2 with a generation_config.json that asks for top_k=1 (greedy whatever the
    temperature) and at most 6 new tokens."""
    path = tmp_path_factory.mktemp("gen") / "model"
    shutil.copytree(qwen2_dir, path)
    gen = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**gen, "top_k": 1, "temperature": 0.7,
                                                             "max_new_tokens": 6, "do_sample": True}))
    return path


def make_llm(model_dir, cache_dir, **kwargs) -> LLM:
    return LLM(str(model_dir), dtype="float32", device="cpu", cache_dir=str(cache_dir), max_model_len=512,
               num_gpu_blocks_override=64, log_level="warning", **kwargs)


def test_library_defaults_come_from_generation_config(model_with_defaults, cache_dir):
    llm = make_llm(model_with_defaults, cache_dir)
    defaults = llm.get_default_sampling_params()
    assert (defaults.top_k, defaults.temperature, defaults.max_tokens) == (1, 0.7, 6)
    assert defaults.top_p == SamplingParams().top_p  # not in the file: Anna's own
    out = llm.generate([PROMPT], use_tqdm=False)[0].outputs[0]
    greedy = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == greedy.token_ids and len(out.token_ids) <= 6
    explicit = llm.generate([PROMPT], SamplingParams(max_tokens=9, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert len(explicit.token_ids) == 9  # SamplingParams given: the file does not apply


def test_none_and_a_folder_choose_other_defaults(model_with_defaults, cache_dir, tmp_path):
    assert make_llm(model_with_defaults, cache_dir, generation_config="none").get_default_sampling_params() \
        == SamplingParams()
    (tmp_path / "generation_config.json").write_text(json.dumps({"max_new_tokens": 3, "top_p": 0.5}))
    defaults = make_llm(model_with_defaults, cache_dir, generation_config=str(tmp_path)).get_default_sampling_params()
    assert (defaults.max_tokens, defaults.top_p, defaults.top_k) == (3, 0.5, 0)


def test_a_bad_generation_config_is_refused_by_name(model_with_defaults, cache_dir, tmp_path):
    with pytest.raises(ValueError, match="^generation_config: .* holds no generation_config.json"):
        make_llm(model_with_defaults, cache_dir, generation_config=str(tmp_path))
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 5}))
    with pytest.raises(ValueError, match="^generation_config: .*generation_config.json: top_p:"):
        make_llm(model_with_defaults, cache_dir, generation_config=str(tmp_path))


def completions(settings, bodies: list[dict]) -> list[dict]:
    app = create_app(settings, load_in_background=False)

    async def go():
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
                return [(await client.post("/v1/completions", json=body, timeout=60)).json() for body in bodies]

    return asyncio.run(go())


def test_server_fills_left_out_fields_and_caps_max_tokens(model_with_defaults, cache_dir):
    from conftest import engine_settings

    settings = engine_settings(model_with_defaults, cache_dir, inference_warmup=False)
    base = {"prompt": PROMPT, "ignore_eos": True}
    plain, greedy, longer, sampled = completions(settings, [
        base, {**base, "temperature": 0}, {**base, "max_tokens": 20},
        {**base, "top_k": -1, "temperature": 1.0, "seed": 3, "logprobs": 1}])
    assert plain["usage"]["completion_tokens"] == 6 and longer["usage"]["completion_tokens"] == 6
    assert plain["choices"][0]["text"] == greedy["choices"][0]["text"] == longer["choices"][0]["text"]
    assert sampled["usage"]["completion_tokens"] == 6
    # top_k=-1 in the request replaces the file's top_k=1: tokens are sampled, so some are not the top choice
    top = sampled["choices"][0]["logprobs"]
    assert any(lp < max(alts.values()) for lp, alts in zip(top["token_logprobs"], top["top_logprobs"]))
