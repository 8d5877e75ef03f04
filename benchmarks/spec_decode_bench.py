"""Speculative decoding on random-weight models: what verification costs, and what it buys.

    python benchmarks/make_random_model.py --out benchmarks/models/qwen2.5-0.5b
    python benchmarks/spec_decode_bench.py verify --model benchmarks/models/qwen2.5-0.5b
    python benchmarks/spec_decode_bench.py ngram --model benchmarks/models/qwen2.5-0.5b
    python benchmarks/spec_decode_bench.py replay --model benchmarks/models/qwen2.5-0.5b
    python benchmarks/spec_decode_bench.py llama-server --model benchmarks/models/qwen2.5-0.5b  (see below)

verify: the time of one target step that verifies K proposed tokens (1 + K tokens of one
sequence) against a plain decode step, K = 1..8, after a --context-token prompt (median of
--repeats steps each). Random weights make acceptance meaningless, so this is the cost side.

ngram: single-stream greedy decoding with and without prompt lookup, in the same run, on a
prompt that holds a passage twice (what the proposer looks up) and asks for --new-tokens more:
tokens/s and acceptance. A random model does not copy, so what the proposer finds is whatever
repetition the model's own output has; the figures say how often that is.

replay: the speed at a chosen acceptance rate. A plain run records the greedy output; speculative
runs then propose its continuation, with each proposed token replaced by a wrong one with
probability 1 - --acceptance (per position, so acceptance 0.7 keeps a 4-token proposal whole
24% of the time). Outputs stay the plain run's (checked); tokens/s against the plain run. The
acceptance back-off is on (the engine's default threshold) unless --min-acceptance-rate 0.

llama-server: the ngram workload sent to a running llama-server (its /completion timings and
draft counts), the same prompt and length; start it with and without its own n-gram speculation:

    llama-server -m qwen2.5-0.5b-f16.gguf -t 2 -c 4096 --port 8081 \
        --spec-type ngram-simple --spec-ngram-simple-size-n 4 --spec-ngram-simple-size-m 4
    python benchmarks/spec_decode_bench.py llama-server --model benchmarks/models/qwen2.5-0.5b
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time

from anna.core.config import ServeSettings
from anna.core.sampling_params import SamplingParams
from anna.core.speculative import SpeculativeConfig
from anna.runtime.engine import LLMEngine
from anna.runtime.scheduler import ScheduledBatch
from anna.runtime.speculative.decoder import ProposalStep, SpeculativeDecoder


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def engine_for(args, spec: dict | None = None, **extra) -> LLMEngine:
    settings = ServeSettings(model=args.model, dtype=args.dtype, quantization=args.quantization, device=args.device,
                             max_model_len=args.max_model_len, max_num_seqs=4, log_level="warning",
                             speculative_config=json.dumps(spec) if spec else "", **extra)
    return LLMEngine(settings.resolve(), show_progress=False)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def verify_cost(args) -> dict:
    k_max = 8
    engine = engine_for(args, {"method": "ngram", "num_speculative_tokens": k_max, "min_acceptance_rate": 0})
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    engine.add_request("r", [rng.randrange(100, vocab) for _ in range(args.context_tokens)], greedy(args.max_model_len - args.context_tokens))
    while not engine.scheduler.running or engine.scheduler.running[0].num_output_tokens == 0:
        engine.step()
    req = engine.scheduler.running[0]
    req.spec_token_ids = []
    rows = {}
    for k in range(k_max + 1):
        assert engine.scheduler.caches.allocate_slots(req, 1 + k)
        batch = ScheduledBatch(requests=[req], num_new_tokens=[1 + k],
                               spec_token_ids=[[rng.randrange(100, vocab) for _ in range(k)]], may_propose=[False])
        times = []
        for i in range(args.repeats + 2):
            t0 = time.perf_counter()
            engine.runner.execute(batch)
            if i >= 2:
                times.append(time.perf_counter() - t0)
        rows[k] = statistics.median(times)
    base = rows[0]
    return {"step_ms": {k: round(v * 1e3, 2) for k, v in rows.items()},
            "vs_plain_decode": {k: round(v / base, 3) for k, v in rows.items()}}


def decode_speed(engine: LLMEngine, prompt: list[int], n: int) -> tuple[float, list[int]]:
    """Tokens/s from the first token to the last, and the output."""
    engine.add_request(f"r{time.perf_counter_ns()}", prompt, greedy(n))
    first = last = None
    out = []
    while engine.has_unfinished_requests():
        for o in engine.step():
            now = time.perf_counter()
            if first is None:
                first = now
            last = now
            if o.finished:
                out = o.outputs[0].token_ids
    return (len(out) - 1) / (last - first), out


def passage_prompt(vocab: int, tokens: int) -> list[int]:
    rng = random.Random(1)
    passage = [rng.randrange(100, vocab) for _ in range(tokens)]
    return passage + passage


def ngram(args) -> dict:
    plain = engine_for(args)
    spec_cfg = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    spec = engine_for(args, spec_cfg)
    prompt = passage_prompt(plain.model_config.vocab_size, args.passage_tokens)
    decode_speed(plain, prompt[:64], 8), decode_speed(spec, prompt[:64], 8)  # warm up
    spec.reset_stats()
    rounds = []
    for _ in range(args.repeats):
        a, out_a = decode_speed(plain, prompt, args.new_tokens)
        b, out_b = decode_speed(spec, prompt, args.new_tokens)
        assert out_a == out_b, "speculative output differs from plain decoding"
        rounds.append((a, b))
    stats = spec.stats.spec
    return {"plain_tok_s": [round(a, 2) for a, _ in rounds], "ngram_tok_s": [round(b, 2) for _, b in rounds],
            "speedup_median": round(statistics.median(b / a for a, b in rounds), 3),
            "acceptance_rate": round(stats.acceptance_rate, 3),
            "mean_acceptance_length": round(stats.mean_acceptance_length, 2), "config": spec_cfg}


class ReplayProposer:
    """Proposes a recorded output's continuation, each token wrong with probability 1 - rate."""

    lookahead = 0

    def __init__(self, output: list[int], k: int, rate: float, vocab: int) -> None:
        self.output, self.k, self.rate, self.vocab = output, k, rate, vocab
        self.rng = random.Random(2)

    def propose(self, step: ProposalStep) -> dict[str, list[int]]:
        out = {}
        for i, req in enumerate(step.requests):
            if step.lengths[i]:
                done = req.num_output_tokens + len(step.new_tokens(i))
                truth = self.output[done:done + self.k]
                out[req.request_id] = [t if self.rng.random() < self.rate else (t + 1) % self.vocab for t in truth]
        return out

    def forget(self, request_id: str) -> None:
        pass


def replay(args) -> dict:
    plain = engine_for(args)
    spec = engine_for(args, {"method": "ngram", "num_speculative_tokens": args.k, "min_acceptance_rate": 0})
    prompt = passage_prompt(plain.model_config.vocab_size, args.passage_tokens)
    decode_speed(plain, prompt[:64], 8), decode_speed(spec, prompt[:64], 8)  # warm up
    results = {}
    for rate in args.acceptance:
        rounds, accepted = [], []
        for _ in range(args.repeats):
            a, out = decode_speed(plain, prompt, args.new_tokens)
            spec.runner.speculative = SpeculativeDecoder(
                SpeculativeConfig("ngram", args.k, 1, 1, min_acceptance_rate=args.min_acceptance_rate),
                ReplayProposer(out, args.k, rate, spec.model_config.vocab_size))
            spec.reset_stats()
            b, out_b = decode_speed(spec, prompt, args.new_tokens)
            assert out_b == out, "speculative output differs from plain decoding"
            rounds.append((a, b))
            accepted.append(spec.stats.spec.acceptance_rate)
        results[str(rate)] = {"plain_tok_s": [round(a, 2) for a, _ in rounds],
                              "spec_tok_s": [round(b, 2) for _, b in rounds],
                              "speedup_median": round(statistics.median(b / a for a, b in rounds), 3),
                              "measured_acceptance": round(statistics.mean(accepted), 3)}
    return results


def llama_server(args) -> dict:
    """The ngram workload against a running llama-server (--base-url): its own timings and draft
    counts, per request (run it once with and once without --spec-type)."""
    import httpx

    vocab = json.load(open(f"{args.model}/config.json"))["vocab_size"]
    prompt = passage_prompt(vocab, args.passage_tokens)
    body = {"prompt": prompt, "n_predict": args.new_tokens, "temperature": 0, "ignore_eos": True, "cache_prompt": False}
    httpx.post(f"{args.base_url}/completion", json={**body, "prompt": prompt[:64], "n_predict": 8}, timeout=600)
    rounds = []
    for _ in range(args.repeats):
        t = httpx.post(f"{args.base_url}/completion", json=body, timeout=600).json()["timings"]
        rounds.append(t)
    drafted = sum(t.get("draft_n", 0) for t in rounds)
    return {"tok_s": [round(t["predicted_per_second"], 2) for t in rounds],
            "acceptance_rate": round(sum(t.get("draft_n_accepted", 0) for t in rounds) / drafted, 3) if drafted else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=("verify", "ngram", "replay", "llama-server"))
    ap.add_argument("--base-url", default="http://127.0.0.1:8081", help="llama-server: where it listens")
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--out", help="also write the result (JSON) here")
    ap.add_argument("--quantization", default="none", choices=("none", "int8", "int4"))
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--context-tokens", type=int, default=512, help="verify: the prompt before the timed steps")
    ap.add_argument("--passage-tokens", type=int, default=400, help="ngram/replay: the passage, given twice")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4, help="ngram/replay: num_speculative_tokens")
    ap.add_argument("--acceptance", type=float, nargs="+", default=[1.0, 0.7, 0.0], help="replay: rates to run")
    ap.add_argument("--min-acceptance-rate", type=float, default=SpeculativeConfig("ngram", 1).min_acceptance_rate,
                    help="replay: the back-off threshold (0 = no back-off); default: the engine's")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    import torch

    result = {"mode": args.mode, "model": args.model, "dtype": args.dtype, "quantization": args.quantization,
              "cpu": cpu_name(), "threads": torch.get_num_threads(),
              "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
              **{"verify": verify_cost, "ngram": ngram, "replay": replay, "llama-server": llama_server}[args.mode](args)}
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
