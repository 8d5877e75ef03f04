"""``anna bench``: serve (suite or load mode), dataset, compare."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

from tqdm import tqdm

from anna.bench import datasets, report
from anna.bench.client import BenchClient
from anna.bench.scenarios import read_dataset, run_load, run_standard_suite
from anna.bench.stats import DEFAULT_TARGETS

API_KEY_ENV = "ANNA_BENCH_API_KEY"


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="Measure any OpenAI-compatible server with a fixed method.",
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    bsub = bench.add_subparsers(dest="bench_command", required=True)

    serve = bsub.add_parser("serve", help="Run the scenario suite, or replay a dataset (load mode).",
                            formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    serve.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    serve.add_argument("--model", required=True, help="The model name the server serves (requests' \"model\").")
    serve.add_argument("--label", required=True, help="A name for this run, in the result file and comparisons.")
    serve.add_argument("--api-key-file", type=Path, help=f"File holding the API key (or set {API_KEY_ENV}).")
    serve.add_argument("--suite", choices=["standard"], default="standard",
                       help="The scenario suite (no --dataset): sequential and concurrent chats, coding, passcodes "
                            "in 8K and 32K archives, each long one cold and repeated.")
    serve.add_argument("--max-tokens", type=int, default=256, help="Answer length of the suite's prompts.")
    serve.add_argument("--seed", type=int, default=0, help="Seed of the requests' sampling and of the suite's texts.")
    serve.add_argument("--dataset", type=Path, help="Load mode: a JSONL file of requests.")
    serve.add_argument("--concurrency", type=int, default=4, help="Load mode: requests in flight at once.")
    serve.add_argument("--duration", type=float, help="Load mode: stop sending after this many seconds.")
    serve.add_argument("--num-requests", type=int, help="Load mode: send this many requests (default: the dataset's).")
    serve.add_argument("--targets", type=Path, help="JSON file overriding the load-mode targets.")
    serve.add_argument("--out", type=Path, help="Result JSON (default: bench-results/LABEL.json).")
    serve.set_defaults(func=cmd_serve)

    ds = bsub.add_parser("dataset", help="Write a seeded production-like dataset (JSONL).",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ds.add_argument("--out", type=Path, required=True, help="The JSONL file to write.")
    ds.add_argument("--seed", type=int, default=0, help="The same seed writes the same file.")
    ds.add_argument("--conversations", type=int, default=32, help="Conversations (each a row per turn).")
    ds.add_argument("--turns", type=int, default=6, help="Most turns per conversation; each extends the last.")
    ds.add_argument("--system-prompts", type=int, default=3, help="Long system prompts shared across conversations.")
    ds.add_argument("--system-words", type=int, default=600, help="Words of each system prompt.")
    ds.add_argument("--max-tokens-per-request", type=int, default=4096,
                    help="A conversation stops before a turn whose prompt and answer would exceed this (estimated).")
    ds.add_argument("--answer-tokens", type=int, default=128, help="max_tokens of every request.")
    ds.set_defaults(func=cmd_dataset)

    cmp = bsub.add_parser("compare", help="A markdown table comparing result files.",
                          formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    cmp.add_argument("results", nargs="+", type=Path, help="Result JSON files of anna bench serve, one column each.")
    cmp.add_argument("--plots", type=Path, help="Also write PNG plots here (needs matplotlib).")
    cmp.set_defaults(func=cmd_compare)


def read_api_key(args: argparse.Namespace) -> str | None:
    if args.api_key_file:
        return args.api_key_file.read_text().strip()
    return os.environ.get(API_KEY_ENV) or None


def cmd_serve(args: argparse.Namespace) -> int:
    client = BenchClient(args.base_url, args.model, read_api_key(args))
    settings = {"suite": None if args.dataset else args.suite, "max_tokens": args.max_tokens, "seed": args.seed,
                "dataset": str(args.dataset) if args.dataset else None, "concurrency": args.concurrency,
                "duration": args.duration, "num_requests": args.num_requests}

    async def run() -> dict:
        try:
            info = await client.server_info()
            if args.dataset:
                rows = read_dataset(args.dataset)
                targets = dict(DEFAULT_TARGETS, **(json.loads(args.targets.read_text()) if args.targets else {}))
                total = args.num_requests or (None if args.duration else len(rows))
                bar = tqdm(total=total, desc=f"load {args.label}", unit="req")
                load = await run_load(client, rows, args.concurrency, args.num_requests, args.duration, args.seed,
                                      lambda _: bar.update(1))
                bar.close()
                return report.load_result(args.label, info, settings, load, targets)
            bar = tqdm(total=9, desc=f"suite {args.label}", unit="scenario")
            scenarios = await run_standard_suite(client, args.max_tokens, args.seed, lambda _: bar.update(1))
            bar.close()
            return report.suite_result(args.label, info, settings, scenarios)
        finally:
            await client.close()

    result = asyncio.run(run())
    out = args.out or Path("bench-results") / f"{args.label}.json"
    report.save(result, out)
    print(report.compare_markdown([result]))
    if result["mode"] == "suite":
        print(result["note"])
    print(f"Results: {out}")
    return 0


def cmd_dataset(args: argparse.Namespace) -> int:
    rows = datasets.generate(args.seed, args.conversations, args.turns, args.system_prompts, args.system_words,
                             args.max_tokens_per_request, args.answer_tokens)
    datasets.write(rows, args.out)
    print(f"wrote {len(rows)} requests to {args.out}")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    results = [json.loads(p.read_text()) for p in args.results]
    sys.stdout.write(report.compare_markdown(results))
    if args.plots:
        for path in report.write_plots(results, args.plots):
            print(f"plot: {path}")
    return 0
