"""Drive Anna's real components step by step, collecting logits, for comparison with transformers."""

from __future__ import annotations

import torch

from anna.core.request import Request
from anna.core.sampling_params import SamplingParams
from anna.runtime.engine import LLMEngine


def run_logits(engine: LLMEngine, prompt: list[int], decode_steps: int, chunks: list[int] | None = None,
               request_id: str = "probe", forced: list[int] | None = None) -> tuple[torch.Tensor, list[int]]:
    """Prefill ``prompt`` (in the given chunk sizes), then decode greedily, or feeding the tokens
    ``forced`` (teacher forcing: the positions of two runs stay comparable where their greedy
    tokens part). Returns the logits of every position [len(prompt) + decode_steps, vocab] and
    the greedy tokens."""
    req = Request(request_id, list(prompt), SamplingParams(max_tokens=decode_steps + 1, temperature=0.0))
    runner, caches = engine.runner, engine.runner.caches  # every cache kind: KV blocks and state slots
    chunks = list(chunks or [len(prompt)])
    assert sum(chunks) == len(prompt)
    logits, tokens = [], []
    try:
        for n in chunks + [1] * decode_steps:
            if n == 1 and req.num_computed_tokens == req.num_tokens:
                req.append_output_token(forced[req.num_output_tokens] if forced else tokens[-1])
            assert caches.allocate_slots(req, n)
            inputs = runner.prepare([req], [n])
            hidden = runner.forward(inputs)
            with torch.inference_mode():
                step_logits = runner.compute_logits(hidden)
            req.num_computed_tokens += n
            logits.append(step_logits)
            if req.num_computed_tokens == req.num_tokens:
                tokens.append(int(step_logits[-1].argmax()))
    finally:
        caches.free(req)
    return torch.cat(logits), tokens


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


def assert_logits_close(ours: torch.Tensor, ref: torch.Tensor, rel: float = 1e-4) -> None:
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    tol = rel * ref.abs().max().item()
    diff = (ours - ref).abs().max().item()
    assert diff <= tol, f"max abs logit diff {diff:.3e} > {tol:.3e}"


def record_batches(engine: LLMEngine) -> list[list[int]]:
    """Record each step's scheduled token counts (num_new_tokens per request) as the engine runs."""
    seen: list[list[int]] = []
    original = engine.runner.execute

    def execute(batch):
        seen.append(list(batch.num_new_tokens))
        return original(batch)

    engine.runner.execute = execute
    return seen


# linear layers Anna keeps unquantized: Qwen2-MoE's shared-expert gate, Gated DeltaNet's b and a
EXACT_LINEARS = ("shared_expert_gate", "in_proj_b", "in_proj_a", "in_proj_ba")


def fake_quantized(model, quant: str, group: int = 32):
    """A copy of the transformers model whose weights Anna quantizes are replaced by their
    dequantized values: every linear layer's, and each expert's of a mixture of experts (stored
    as one [experts, rows, cols] tensor); routers and EXACT_LINEARS stay exact, as in Anna."""
    import copy

    from anna.model.quantization import dequantize_int4, dequantize_int8, quantize_int4, quantize_int8

    def round_trip(w: torch.Tensor) -> None:
        if quant == "int8":
            w.copy_(dequantize_int8(*quantize_int8(w)))
        else:
            w.copy_(dequantize_int4(*quantize_int4(w, group), group))

    fake = copy.deepcopy(model)
    with torch.no_grad():
        for name, module in fake.named_modules():
            if isinstance(module, torch.nn.Linear) and not name.endswith(EXACT_LINEARS):
                round_trip(module.weight)
            elif name.endswith(".experts"):
                for param in module.parameters(recurse=False):
                    for expert in param:
                        round_trip(expert)
    return fake
