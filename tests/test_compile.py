"""torch.compile of the forward pass gives the same tokens as eager; a compile failure falls back
to eager with one warning. (Compiling costs tens of seconds on CPU, so there are few of these.)"""

from __future__ import annotations

import logging

import pytest

from anna import LLM, SamplingParams
from conftest import skip_without_cpu_kernels

PROMPTS = [[5 + i + j for j in range(30 + 7 * i)] for i in range(3)]


def tokens(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def make(qwen2_dir, cache_dir, tmp_path, **kw) -> LLM:
    return LLM(str(qwen2_dir), dtype="float32", device="cpu", cache_dir=str(cache_dir), max_model_len=512,
               num_gpu_blocks_override=128, torchinductor_cache_dir=str(tmp_path / "inductor"), **kw)


@pytest.fixture(scope="module")
def eager_tokens(qwen2_dir, cache_dir, tmp_path_factory):
    llm = make(qwen2_dir, cache_dir, tmp_path_factory.mktemp("eager"))
    assert llm.llm_engine.compile_mode == "none"  # auto on CPU
    return tokens(llm)


def test_compiled_fullgraph_forward_matches_eager(cache_dir, tmp_path):
    """...and compiles two graphs for it: the prompts' prefill and decode, whose batch and block
    tables change size from step to step without compiling again. (One layer: compiling unrolls
    the layers, ~30 s each on a 2-core CPU.)"""
    from torch._dynamo.utils import counters

    from conftest import build_hf_model, save_hf_model

    one_layer = save_hf_model(build_hf_model("qwen2", num_hidden_layers=1), tmp_path / "qwen2")
    eager = tokens(make(one_layer, cache_dir, tmp_path))
    llm = make(one_layer, cache_dir, tmp_path, compile_mode="default", compile_fullgraph=True, cpu_kernels=False)
    assert llm.llm_engine.runner.model_forward.compiled is not None
    counters.clear()
    assert tokens(llm) == eager
    assert counters["stats"]["unique_graphs"] == 2
    assert llm.llm_engine.runner.model_forward.compiled is not None  # it really ran compiled
    assert any((tmp_path / "inductor").iterdir())  # and used the configured cache directory


def test_the_parts_a_module_leaves_eager_are_not_traced():
    """A method named in a module's eager_under_compile runs eager inside the compiled forward (the
    MoE's expert loop reads its counts back to the host: traced, every new routing would compile
    again). Here three calls with other counts reuse the forward's two pieces around it."""
    import torch
    from torch._dynamo.utils import counters

    from anna.runtime.compilation import keep_eager_parts

    class Routed(torch.nn.Module):
        eager_under_compile = ("spread",)

        def forward(self, x):
            return self.spread(x * 2) + 1

        def spread(self, x):
            counts = torch.bincount((x > 0).long(), minlength=2).tolist()
            return x * counts[1]

    module = Routed()
    keep_eager_parts(module)
    compiled = torch.compile(module.forward, backend="eager", dynamic=True)
    counters.clear()
    for x in (torch.tensor([1.0, -1, 2]), torch.tensor([-1.0, -1, 2, 4]), torch.tensor([1.0, 1, 2])):
        assert torch.equal(compiled(x), 2 * x * int((x > 0).sum()) + 1)
    assert counters["stats"]["unique_graphs"] == 2  # traced, spread gives 4


def test_compile_failure_falls_back_to_eager(qwen2_dir, cache_dir, tmp_path, eager_tokens, caplog):
    # fullgraph cannot trace through Anna's C kernels (called with ctypes): compilation fails
    skip_without_cpu_kernels()
    llm = make(qwen2_dir, cache_dir, tmp_path, compile_mode="default", compile_fullgraph=True)
    with caplog.at_level(logging.WARNING, logger="anna.runtime.compilation"):
        assert tokens(llm) == eager_tokens
    assert llm.llm_engine.runner.model_forward.compiled is None
    assert sum("running eager from now on" in r.message for r in caplog.records) == 1


def test_decode_executors_give_the_same_tokens(qwen2_dir, cache_dir, tmp_path, eager_tokens, hf_models):
    """graph (on CPU the fused C decode stack) and eager (layer by layer) decode the same tokens,
    which are transformers' greedy tokens."""
    from helpers import hf_greedy

    skip_without_cpu_kernels()  # (without them graph runs eager: the test below)
    graph = make(qwen2_dir, cache_dir, tmp_path)
    assert graph.llm_engine.decode_executor == "graph"  # auto on CPU
    eager = make(qwen2_dir, cache_dir, tmp_path, decode_executor="eager")
    assert eager.llm_engine.decode_executor == "eager"
    assert eager.llm_engine.runner.decode_executor is None
    assert tokens(eager) == tokens(graph) == eager_tokens
    assert eager_tokens[0] == hf_greedy(hf_models["qwen2"][0], PROMPTS[0], 12)


def test_graph_executor_without_cpu_kernels_runs_eager_with_one_warning(qwen2_dir, cache_dir, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="anna.runtime.compilation"):
        llm = make(qwen2_dir, cache_dir, tmp_path, decode_executor="graph", cpu_kernels=False)
    assert llm.llm_engine.decode_executor == "eager"
    assert sum("decode_executor=graph" in r.message for r in caplog.records) == 1
