"""Tensor parallelism on one host: TP=2 (one process per rank, the cores shared out) against TP=1
(one process with all of them), batch-1 decode and 16 streams, with the time each step spends in
the ranks' collectives.

    python benchmarks/make_random_model.py --out benchmarks/models/qwen2.5-0.5b
    python benchmarks/tensor_parallel_bench.py --model benchmarks/models/qwen2.5-0.5b

Configurations, alternated in rounds so that a VM's drift lands on all of them: ``tp1`` (the
default: the fused decode stack), ``tp1-eager`` (layer by layer, the path TP=2 takes on every
rank), ``tp2``. Decode: one request, --prompt-tokens random tokens, --new-tokens with ignore_eos,
tok/s over the decode steps (first token excluded). Streams: --streams requests at once, all
output tokens / wall time from submitting to the last token (prefill included), and the decode
phase's rate (tokens after the last first token / its time). Collectives: rank 0's time in
all-reduce and all-gather per decode step (the wait for the slower rank included), calls and
bytes per step; commands (rank 0 -> the other ranks) are timed as the rest of the step. First,
--collectives CALLS calls of each collective between two processes, through gloo and through
Anna's shared-memory collectives, in microseconds per call.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from anna import LLM, SamplingParams

CONFIGS = {"tp1": dict(tensor_parallel_size=1), "tp1-eager": dict(tensor_parallel_size=1, decode_executor="eager"),
           "tp2": dict(tensor_parallel_size=2)}


def collectives(llm: LLM):
    shard = llm.llm_engine.runner.model.vocab_shard
    return shard.comm if shard is not None else None


def decode(llm: LLM, prompt: list[int], new_tokens: int, rid: str) -> dict:
    engine = llm.llm_engine
    comm = collectives(llm)
    engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True))
    stamps = []
    base = None
    while engine.has_unfinished_requests():
        if stamps and base is None and comm is not None:  # after the prefill step
            base = (comm.seconds, comm.calls, comm.bytes)
        if engine.step():
            stamps.append(time.perf_counter())
    steps = len(stamps) - 1
    out = {"decode_tok_s": steps / (stamps[-1] - stamps[0])}
    if comm is not None:
        out.update(collective_ms_per_step=(comm.seconds - base[0]) * 1e3 / steps,
                   collective_calls_per_step=(comm.calls - base[1]) / steps,
                   collective_kib_per_step=(comm.bytes - base[2]) / 1024 / steps,
                   step_ms=(stamps[-1] - stamps[0]) * 1e3 / steps)
    return out


def streams(llm: LLM, prompts: list[list[int]], new_tokens: int, tag: str) -> dict:
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", p, params)
    started: set[str] = set()
    last_first = None
    tokens_after = 0
    total = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            n = len(out.outputs[0].token_ids)
            if out.request_id not in started:
                started.add(out.request_id)
                if len(started) == len(prompts):
                    last_first, tokens_after = time.perf_counter(), 0
            elif last_first is not None:
                tokens_after += 1
            if out.finished:
                total += n
    end = time.perf_counter()
    return {"streams_tok_s": total / (end - t0), "streams_decode_tok_s": tokens_after / (end - last_first)}


def _collectives_rank(rank: int, port: int, shm_path: str, calls: int, out: dict) -> None:
    import torch.distributed as dist

    from anna.parallel.collectives import Collectives, SharedMemoryCollectives

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    shapes = {"all_reduce 1 x 896": (1, 896), "all_reduce 16 x 896": (16, 896),
              "all_gather 16 x 75968": (16, 75968)}
    for kind, comm in (("gloo", Collectives(2)), ("shared memory", SharedMemoryCollectives(2, rank, shm_path))):
        for name, shape in shapes.items():
            x = torch.randn(shape)
            op = comm.all_gather if name.startswith("all_gather") else comm.all_reduce
            for _ in range(20):
                op(x)
            dist.barrier()
            start = time.perf_counter()
            for _ in range(calls):
                op(x)
            if rank == 0:
                out[f"{kind}: {name}"] = (time.perf_counter() - start) / calls * 1e6
        comm.close()
    dist.destroy_process_group()


def measure_collectives(calls: int) -> dict:
    """Microseconds per call between 2 processes of this host, through gloo and through Anna's
    shared-memory collectives (parallel/collectives.py)."""
    import socket
    import uuid

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_collectives_rank, args=(port, f"/dev/shm/anna-bench-{uuid.uuid4().hex}", calls, out), nprocs=2)
        return dict(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--stream-prompt-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--collectives", type=int, default=500, metavar="CALLS",
                    help="also time CALLS all-reduces / all-gathers through gloo and shared memory (0: skip)")
    args = ap.parse_args()
    collective_us = measure_collectives(args.collectives) if args.collectives else {}
    for name, us in collective_us.items():
        print(f"{name}: {us:.1f} us per call", flush=True)

    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, 30000, (args.prompt_tokens,), generator=gen).tolist()
    stream_prompts = [torch.randint(100, 30000, (args.stream_prompt_tokens,), generator=gen).tolist()
                      for _ in range(args.streams)]
    runs: dict[str, list[dict]] = {name: [] for name in args.configs}
    for r in range(args.rounds):
        for name in args.configs:
            llm = LLM(args.model, dtype=args.dtype, quantization=args.quantization, max_model_len=2048,
                      max_num_seqs=max(16, args.streams), log_level="warning", inference_warmup=False,
                      **CONFIGS[name])
            try:
                decode(llm, prompt, 8, f"warm-{r}")  # first-use costs (buffers, kernels' first calls)
                result = {**decode(llm, prompt, args.new_tokens, f"d-{r}"),
                          **streams(llm, stream_prompts, args.new_tokens, f"s-{r}")}
            finally:
                llm.shutdown()
            runs[name].append(result)
            print(name, json.dumps({k: round(v, 3) for k, v in result.items()}), flush=True)
    summary = {name: {k: statistics.median(run[k] for run in results) for k in results[0]}
               for name, results in runs.items()}
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    report = {"cpu": cpu, "cores": torch.get_num_threads(), "torch": torch.__version__, "model": args.model,
              "dtype": args.dtype, "quantization": args.quantization, "args": vars(args), "runs": runs,
              "median": summary, "collective_us_per_call": collective_us}
    print(json.dumps(summary, indent=2))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
