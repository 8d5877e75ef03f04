"""Answer quality of a model that knows its tasks: the built-in demo model, trained on them.

    python benchmarks/quality_bench.py retrieval --lengths 1024 2048 3072 4000 --trials 20 --max-model-len 4096 \\
        --kv-cache-dtypes float32 bfloat16 int8 fp8_e4m3 turboquant4 turboquant3 --quantization none int8 int4
    python benchmarks/quality_bench.py speculation --draft DRAFT_DIR --trials 8 --passage-words 120 [--task edit]

retrieval: passcode accuracy over ``--trials`` seeded archives per length, built the way ``anna
bench`` builds its passcode prompts (its record lines and question), with the passcode line at
depths spread evenly from the first line to the last. A trial passes as the bench's check does:
the passcode is in the answer and the answer ends with a stop. Each KV cache type and each weight
format is a separate engine on the same prompts, so the rows differ only in what they store.

speculation: greedy copying of ``--trials`` seeded passages (``--task copy``: ``tiny_tasks.copy``; or
``edit``: copying with one word replaced), plainly, with n-gram prompt lookup and with the draft
model (``--draft``): acceptance rate, tokens/s, exact-answer accuracy, and a check that every
speculative output equals the plain one.

Without ``--model`` the built-in demo model is used. Each run prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tiny_tasks  # noqa: E402
from anna import LLM, SamplingParams  # noqa: E402
from anna.bench.scenarios import passcode_question  # noqa: E402
from spec_decode_bench import cpu_name  # noqa: E402


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def retrieval_prompts(llm: LLM, length: int, trials: int, seed: int) -> list[tuple[str, str]]:
    """(prompt text, passcode) pairs whose chat-rendered prompts are about ``length`` tokens."""
    tok = llm.get_tokenizer()
    out = []
    for i in range(trials):
        rng = random.Random(seed * 1_000_003 + length * 1_009 + i)
        passcode = f"{rng.randrange(10**5, 10**6)}"
        depth = (i + 0.5) / trials
        lines = max(1, length // 21)
        for _ in range(4):  # refine the line count with the model's tokenizer
            state = rng.getstate()
            text = passcode_question(tiny_tasks.archive_at_depth(rng, lines, passcode, depth))
            rng.setstate(state)
            count = len(tok.encode(text, add_special_tokens=False)) + 20  # the chat template's tokens
            if abs(count - length) <= length * 0.02:
                break
            lines = max(1, round(lines * length / count))
        out.append((text, passcode))
    return out


def retrieval(args) -> dict:
    results = []
    longest = args.max_model_len or max(args.lengths) + 64
    for quant in args.quantization:
        for kv in args.kv_cache_dtypes:
            llm = LLM(args.model, kv_cache_dtype=kv, quantization=quant, max_model_len=longest, max_num_seqs=4,
                      log_level="warning", enable_prefix_caching=False)
            row = {"quantization": quant, "kv_cache_dtype": kv, "accuracy": {}}
            t0 = time.perf_counter()
            for length in args.lengths:
                prompts = retrieval_prompts(llm, length, args.trials, args.seed)
                outs = llm.chat([user(p) for p, _ in prompts], SamplingParams(temperature=0, max_tokens=16),
                                use_tqdm=False)
                passed = sum(code in o.outputs[0].text and o.outputs[0].finish_reason == "stop"
                             for (_, code), o in zip(prompts, outs))
                row["accuracy"][length] = round(passed / len(prompts), 3)
                if args.verbose:
                    for (_, code), o in zip(prompts, outs):
                        print(length, code, repr(o.outputs[0].text), file=sys.stderr)
            row["seconds"] = round(time.perf_counter() - t0, 1)
            print(json.dumps(row), file=sys.stderr, flush=True)
            results.append(row)
            llm.shutdown()
    return {"task": "retrieval", "trials": args.trials, "lengths": args.lengths, "rows": results}


def single_stream_outputs(llm: LLM, chats: list[tiny_tasks.Chat], max_tokens: int) -> tuple[list, float]:
    """Outputs of the chats one at a time (single stream, as speculation is measured), and tokens/s."""
    outs, tokens, t0 = [], 0, time.perf_counter()
    for chat in chats:
        o = llm.chat(user(chat.prompt), SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)[0]
        outs.append(o)
        tokens += len(o.outputs[0].token_ids)
    return outs, tokens / (time.perf_counter() - t0)


def speculation(args) -> dict:
    rng = random.Random(args.seed)
    chats = [getattr(tiny_tasks, args.task)(rng, args.passage_words) for _ in range(args.trials)]
    configs = {"plain": None,
               "ngram": {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 2,
                         "prompt_lookup_max": 4}}
    if args.draft:
        configs["draft_model"] = {"method": "draft_model", "model": args.draft, "num_speculative_tokens": args.k}
    rows, plain = {}, None
    for name, spec in configs.items():
        llm = LLM(args.model, max_num_seqs=1, log_level="warning",
                  speculative_config=json.dumps(spec) if spec else "")
        single_stream_outputs(llm, chats[:1], 16)  # warm up
        llm.llm_engine.reset_stats()
        outs, tok_s = single_stream_outputs(llm, chats, args.passage_words * 3)
        texts = [o.outputs[0].text for o in outs]
        row = {"tok_s": round(tok_s, 2),
               "exact_answers": sum(t == c.answer for t, c in zip(texts, chats)) / len(chats)}
        if spec:
            stats = llm.llm_engine.stats.spec
            row.update(acceptance_rate=round(stats.acceptance_rate, 3),
                       mean_acceptance_length=round(stats.mean_acceptance_length, 2),
                       same_as_plain=[o.outputs[0].token_ids for o in outs] == plain)
        else:
            plain = [o.outputs[0].token_ids for o in outs]
        rows[name] = row
        print(json.dumps({name: row}), file=sys.stderr, flush=True)
        llm.shutdown()
    for name, row in rows.items():
        row["speedup"] = round(row["tok_s"] / rows["plain"]["tok_s"], 3)
    return {"task": f"speculation on {args.task}", "trials": args.trials, "passage_words": args.passage_words,
            "k": args.k, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("retrieval", "speculation"))
    ap.add_argument("--model", default=None, help="model directory (default: the built-in demo model)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    ap.add_argument("--max-model-len", type=int, default=0, help="0 = the longest length + 64")
    ap.add_argument("--kv-cache-dtypes", nargs="+", default=["float32"])
    ap.add_argument("--quantization", nargs="+", default=["none"])
    ap.add_argument("--draft", default=None, help="draft model directory for the speculation run")
    ap.add_argument("--passage-words", type=int, default=120)
    ap.add_argument("--task", choices=("copy", "edit"), default="copy", help="what the speculation run asks for")
    ap.add_argument("--k", type=int, default=4, help="speculative tokens per step")
    ap.add_argument("--verbose", action="store_true", help="print every retrieval answer")
    args = ap.parse_args()
    result = retrieval(args) if args.what == "retrieval" else speculation(args)
    print(json.dumps({"cpu": cpu_name(), "model": args.model or "demo", **result}, indent=1))


if __name__ == "__main__":
    main()
