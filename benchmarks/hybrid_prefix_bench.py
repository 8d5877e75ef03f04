"""Multi-turn chat on a hybrid model (Qwen3.5 shapes), with and without state snapshots.

    python benchmarks/make_random_model.py --shape qwen3.5-0.8b --out benchmarks/models/qwen3.5-0.8b
    python benchmarks/hybrid_prefix_bench.py --model benchmarks/models/qwen3.5-0.8b

Each conversation: a system prompt and a document (--context tokens), then --turns user turns;
turn t's prompt is turn t-1's prompt, its answer and a new user message (as a chat client sends
it), so no two prompts are equal and only prefix reuse can help. The same conversations run with
--state-snapshots auto and 0 (no prefix reuse for the recurrent layers, which is also all the
exact prompt cache could do here: it only serves a prompt equal to an earlier one). Reported per
turn: time to first token and prompt tokens found cached, medians over the conversations.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

from anna import LLM, SamplingParams


def conversation(seed: int, context: int, turns: int, user: int) -> list[list[int]]:
    """Token ids of the system prompt + document and of each new user message."""
    def tokens(n: int, salt: int) -> list[int]:
        return [(i * 7919 + salt * 104729 + seed * 31) % 700 + 3 for i in range(n)]
    return [tokens(context, 0)] + [tokens(user, t + 1) for t in range(turns)]


def run(llm: LLM, parts: list[list[int]], answer: int) -> list[tuple[float, int]]:
    engine = llm.llm_engine
    prompt = list(parts[0])
    out = []
    for t, message in enumerate(parts[1:]):
        prompt = prompt + message
        rid = f"c{id(parts)}-{t}"
        start = time.perf_counter()
        engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=answer, ignore_eos=True))
        first, final = None, None
        while engine.has_unfinished_requests():
            for o in engine.step():
                first = first or time.perf_counter()
                final = o
        out.append((first - start, final.num_cached_tokens))
        prompt = prompt + final.outputs[0].token_ids
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--user-tokens", type=int, default=48)
    ap.add_argument("--answer-tokens", type=int, default=32)
    ap.add_argument("--conversations", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/hybrid_prefix_bench.json"))
    args = ap.parse_args()
    results = {"machine": platform.processor() or platform.machine(), "model": args.model, "context": args.context,
               "turns": args.turns, "user_tokens": args.user_tokens, "answer_tokens": args.answer_tokens}
    for snapshots in (-1, 0):
        llm = LLM(args.model, dtype=args.dtype, max_model_len=4096, state_snapshots=snapshots)
        runs = [run(llm, conversation(c, args.context, args.turns, args.user_tokens), args.answer_tokens)
                for c in range(args.conversations)]
        name = "snapshots_auto" if snapshots < 0 else "snapshots_off"
        results[name] = [{"turn": t + 1, "ttft_s": statistics.median(r[t][0] for r in runs),
                          "cached_tokens": statistics.median(r[t][1] for r in runs)} for t in range(args.turns)]
        del llm
    print(json.dumps(results, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
