"""Every tunable of Anna in one place, and the one resolver that fills them in.

Each field of :class:`ServeSettings` defaults to ``None`` ("not set"). :func:`resolve_settings`
fills every unset field from, in order: an explicit value (CLI flag or keyword argument),
the ``ANNA_<FIELD>`` environment variable, the scheduler profile, the built-in default.
Nothing else in Anna reads the environment.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Mapping

from anna.core.speculative import parse_speculative_config
from anna.model.kv_format import KV_CACHE_DTYPE_ALIASES, KV_CACHE_DTYPES

ENV_PREFIX = "ANNA_"

# Scheduler profiles: named sets of defaults, each overridable by its own field.
SCHEDULER_PROFILES: dict[str, dict[str, Any]] = {
    "throughput": {
        "prefill_interval_steps": 4,
        "scheduler_event_driven_prefill_insert": True,
        "skip_batch_wait_when_idle": True,
        "batch_wait_ms": 2.0,
        "long_prefill_token_threshold": 512,
    },
    "interactive": {
        "prefill_interval_steps": 1,
        "scheduler_event_driven_prefill_insert": False,
        "skip_batch_wait_when_idle": True,
        "batch_wait_ms": 0.0,
        "long_prefill_token_threshold": 256,
    },
}


# vLLM engine arguments that have no effect in Anna, accepted (and logged) so that vLLM code and
# command lines run unchanged; the value says whether the command-line flag takes a value.
IGNORED_VLLM_ARGS = {"trust_remote_code": False, "enforce_eager": False, "disable_log_stats": False,
                     "disable_log_requests": False, "enable_auto_tool_choice": False, "enable_chunked_prefill": False,
                     "max_seq_len_to_capture": True, "swap_space": True, "tokenizer_mode": True, "revision": True,
                     "download_dir": True, "load_format": True}
RENAMED_VLLM_ARGS = {"gpu_memory_utilization": "memory_utilization"}


def _setting(default: Any, help: str, *, choices: tuple | None = None, env: str | None = None,
             cli: bool = True, minimum: float = 0, maximum: float | None = None, several: bool = False,
             aliases: tuple[str, ...] = (), parse: Any = None, env_fallbacks: tuple[str, ...] = ()) -> Any:
    """A ServeSettings field: unset (None) until resolved; ``default`` is the built-in value.
    ``several``: a comma-separated list, whose flag also takes the values one after another.
    ``aliases``: other names of the same setting (each a flag, an ANNA_* variable and an LLM
    keyword), as the founding manual spells them. ``parse``: checks a value and returns its
    canonical form (for structured values such as JSON). ``env_fallbacks``: variables other launchers
    set (torchrun's MASTER_ADDR, ...), read after the ANNA_* ones."""
    return field(default=None, metadata={"default": default, "help": help, "choices": choices, "env": env,
                                         "cli": cli, "minimum": minimum, "maximum": maximum, "several": several,
                                         "aliases": aliases, "parse": parse, "env_fallbacks": env_fallbacks})


PROFILE = object()  # marker: the built-in default comes from the scheduler profile


@dataclass
class ServeSettings:
    """Engine and server settings. ``None`` means "use the env variable or the built-in default"."""

    # Model and device
    model: str | None = _setting(None, "Model directory (Hugging Face layout). Default: the built-in demo model.")
    served_model_name: str | None = _setting(
        None, "Names the API serves the model under, comma-separated (or one after another after the flag); "
        "responses report the first. Default: the model path.", several=True)
    tokenizer: str | None = _setting(None, "Tokenizer directory (default: the model directory).")
    chat_template: str | None = _setting(
        "", "Chat template (Jinja), as a file path or inline; empty = the tokenizer's (ChatML if it has none).")
    dtype: str | None = _setting("auto", "Weight and activation dtype; auto = the checkpoint's.",
                                 choices=("auto", "bfloat16", "float16", "float32"))
    device: str | None = _setting("auto", "Device to run on; auto picks cuda, then xpu, then cpu.",
                                  choices=("auto", "cpu", "cuda", "xpu"))
    seed: int | None = _setting(0, "Seed of the sampler for requests that give no seed of their own.")
    generation_config: str | None = _setting(
        "auto", "Default sampling parameters of requests that leave them out: auto = the model's "
                "generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty; max_new_tokens caps "
                "max_tokens on the server), none = Anna's (temperature 1, no top-p/top-k), or a folder holding a "
                "generation_config.json.")
    cache_dir: str | None = _setting("~/.cache/anna", "Where Anna keeps the demo model and other caches.")
    memory_utilization: float | None = _setting(
        0.9, "Fraction of GPU memory Anna may use (weights, activations and KV cache).", maximum=1)
    max_model_len: int | None = _setting(0, "Longest sequence (prompt + output); 0 = the model's max_position_embeddings.")
    weight_load_pipeline_workers: int | None = _setting(
        2, "Background threads that pre-read the next checkpoint shards while the current one is copied.")
    quantization: str | None = _setting(
        "auto", "Weight-only quantization: auto = the checkpoint's own (a GGUF's or a GPTQ/AWQ/compressed-tensors "
                "checkpoint's int4/int8 in Anna's formats, repacked where exact; FP8 and float checkpoints: none); "
                "none = floats (a quantized checkpoint is dequantized); int8/int4 = quantized at load time.",
        choices=("auto", "none", "int8", "int4"))
    int4_group_size: int | None = _setting(32, "int4: input columns that share one scale.", choices=(32, 64, 128))
    int8_group_size: int | None = _setting(
        0, "int8: input columns that share one scale; 0 = one scale per row (a GGUF's Q8_0: 32).",
        choices=(0, 32, 64, 128))
    int4_matmul: str | None = _setting(
        "auto", "int4 execution: packed (kernel reads int4), dequant (unpack + dense GEMM), auto (by M).",
        choices=("auto", "packed", "dequant"), aliases=("xpu_int4_matmul",))
    int4_gemv_m_threshold: int | None = _setting(
        -1, "int4 auto routing: matmuls with M <= this use the packed kernel, larger ones dequant; 0 = always "
            "dequant; -1 = by the CPU: 128 where a bf16 model's dequantized GEMM runs on AMX tiles (cpu_isa), "
            "else 2048.", minimum=-1, aliases=("xpu_int4_gemv_m_threshold",))
    int8_gemv_m_threshold: int | None = _setting(
        -1, "int8 routing: matmuls with M <= this use the packed kernel, larger ones dequant; 0 = always dequant; "
            "-1 = by the CPU, as int4_gemv_m_threshold.", minimum=-1)
    int4_cache_dir: str | None = _setting(
        "", "Where the int4 layout cache lives; empty = {model}/.anna/int4_cache (user cache dir if read-only).")
    int4_cache_load_workers: int | None = _setting(8, "Threads that read (and verify) the int4 layout cache.",
                                                   aliases=("xpu_int4_cache_load_workers",))
    disable_int4_cache: bool | None = _setting(False, "Never read or write the int4 layout cache.",
                                               aliases=("xpu_disable_int4_cache",))
    cpu_kernels: bool | None = _setting(
        True, "Use Anna's compiled CPU matmul kernels for decode-sized matmuls (built with the C compiler).")
    cpu_kernel_compiler: str | None = _setting(
        "", "C compiler that builds Anna's CPU kernels; empty = the CC environment variable, else cc, else gcc.")
    cpu_isa: str | None = _setting(
        "auto", "x86 kernel level: auto = the highest this CPU has (named in the start-up log); a lower one forces "
                "that level's paths (avx2: today's AVX2 kernels, large bf16 matmuls through fp32; from avx512_bf16 "
                "on, large bf16 matmuls run in bf16 on oneDNN's AVX512-BF16/AMX kernels). One the CPU lacks is "
                "refused.", choices=("auto", "none", "avx2", "avx512", "avx512_vnni", "avx512_bf16", "amx"))
    cpu_gemv_max_rows: int | None = _setting(
        128, "Largest M (rows) routed to Anna's CPU matmul kernel; larger matmuls use torch.")
    cpu_upcast_min_rows: int | None = _setting(
        8, "Without Anna's CPU kernels: from this M on, half-precision matmuls run in fp32 (0 = never).")
    cpu_bf16_dot_min_rows: int | None = _setting(
        -1, "A bf16 model on a CPU with AVX512-BF16: from this M on, Anna's weight-streaming kernel rounds the "
            "rows of x to bf16 and multiplies on vdpbf16ps (twice the fp32 FMA's rate where the CPU runs it at full "
            "width); 0 = never (x stays fp32); -1 = 8 where the CPU has AVX512-BF16 (cpu_isa), else never.",
        minimum=-1)
    cpu_bf16_pair_max_rows: int | None = _setting(
        -1, "A bf16 model on a CPU without AVX512-BF16 (the avx2 kernel level): from 4 up to this M, Anna's "
            "weight-streaming kernel widens bf16 weights to fp32 in registers (a shift and a mask) for each 4 rows "
            "of x; at other M it converts each block of weights once for all rows. 0 = never; -1 = 32.",
        minimum=-1)
    cpu_sdpa_min_tokens: int | None = _setting(
        -1, "On CPU with Anna's kernels: a prompt chunk attending over a context of at least this many tokens runs "
            "torch's scaled_dot_product_attention (oneDNN; bf16 on AMX tiles where the CPU has them) instead of "
            "Anna's prefill attention kernel; 0 = never; -1 = by the CPU: 1 where the prefill attention runs in "
            "bf16 on an AMX CPU whose kernels were built without AMX tiles (cpu_isa), else never.", minimum=-1)
    cpu_mlp_tile_rows: int | None = _setting(
        256, "On CPU, a gated MLP of more rows (prefill) runs in tiles of this many where Anna's kernels serve a "
             "tile from the stored weights, so that its wide intermediate rows stay in cache between its two "
             "matmuls; 0 = whole.")
    calibrate: bool | None = _setting(
        True, "On CPU, the first start on a new host times this model's layers (a few seconds, before serving) to "
              "set cpu_gemv_max_rows, cpu_bf16_dot_min_rows, cpu_bf16_pair_max_rows, int4_gemv_m_threshold, "
              "int8_gemv_m_threshold, "
              "cpu_upcast_min_rows, cpu_sdpa_min_tokens and the "
              "throughput profile's "
              "long_prefill_token_threshold, kept in {cache_dir}/calibration; a flag or ANNA_* value still wins "
              "(`anna tune MODEL` measures again). --no-calibrate: the built-in values.")
    cpu_huge_pages: bool | None = _setting(
        True, "On CPU, keep the weights and the KV cache on transparent huge pages (Linux): fewer TLB misses.")

    # Parallelism
    tensor_parallel_size: int | None = _setting(
        1, "Ranks the model is split across (attention heads, MLP and expert columns, the vocabulary): one process "
           "each, with its share of the CPU cores or its own GPU; the engine and scheduler stay in the first. "
           "Across nodes with --nnodes (each node runs its share of the ranks).", minimum=1, aliases=("tp",))
    distributed_executor_backend: str | None = _setting(
        "mp", "How the other ranks are started: mp (processes on this node, and `anna serve --node-rank N` on the "
              "others) or ray (Ray actors on the Ray cluster this process joins; needs `pip install anna[ray]`).",
        choices=("mp", "ray"))
    nnodes: int | None = _setting(1, "Nodes the tensor-parallel ranks are spread over, as many ranks on each.",
                                  minimum=1, env_fallbacks=("NNODES", "GROUP_WORLD_SIZE"))
    node_rank: int | None = _setting(
        0, "This node's index: 0 serves (engine, scheduler, HTTP), the others only run their ranks' share of the "
           "model.", env_fallbacks=("NODE_RANK", "GROUP_RANK"))
    master_addr: str | None = _setting(
        "127.0.0.1", "Address of node 0, where the ranks meet (torch.distributed's TCP rendezvous).",
        env_fallbacks=("MASTER_ADDR",))
    master_port: int | None = _setting(
        0, "Port of that rendezvous on node 0; 0 = a free port (one node only).", maximum=65535,
        env_fallbacks=("MASTER_PORT",))

    # KV cache
    block_size: int | None = _setting(16, "Tokens per KV cache block.", minimum=1)
    kv_cache_memory: float | None = _setting(
        0.0, "KV cache budget in GiB; 0 = automatic (a fraction of free device memory, on CPU of available RAM).")
    kv_cache_dtype: str | None = _setting(
        "auto", "How the paged KV cache stores K and V rows: auto = the activation dtype (fp32 on CPU, the model's "
                "dtype on GPU); bfloat16/float16; fp8_e4m3 (fp8) or int8 with a scale per row; turboquant4/turboquant3 "
                "(a fixed random rotation, then 4 or 3 bits per value on a Lloyd-Max codebook, with a norm per row).",
        choices=(*KV_CACHE_DTYPES, *KV_CACHE_DTYPE_ALIASES))
    num_gpu_blocks_override: int | None = _setting(0, "Exact number of KV blocks (overrides the memory budget); 0 = off.")
    enable_prefix_caching: bool | None = _setting(True, "Share full KV blocks between requests with the same prefix.")
    min_free_memory_mib: float | None = _setting(
        1024.0, "Safety floor of free memory (MiB): below it an idle engine releases KV memory at once.")
    memory_release_sweep_interval_s: float | None = _setting(
        30.0, "Seconds between the idle engine's memory-release checks; 0 = no periodic checks.")
    memory_release_min_free_mib: float | None = _setting(
        -1.0, "Periodic check: release when free memory is below this (MiB); -1 = min_free_memory_mib.", minimum=-1)
    memory_release_max_gap_mib: float | None = _setting(
        1024.0, "Periodic check: release when resident-but-unused KV memory exceeds this (MiB); 0 = off.")
    kv_release_chunk_blocks: int | None = _setting(64, "KV blocks per chunk, the unit memory is returned in.")
    kv_commit_ahead_mib: float | None = _setting(
        256.0, "An idle server commits this much fresh KV memory (MiB) ahead of use, so that no decode step waits "
               "on the page faults of first writes (CPU; at most memory_release_max_gap_mib); 0 = off.")
    state_snapshots: int | None = _setting(
        -1, "Models with recurrent layers (Qwen3.5, Qwen3-Next): states kept at block boundaries of cached prefixes, "
            "which prefix reuse needs; -1 = auto (max_num_seqs), 0 = off (no prefix reuse for such models).",
        minimum=-1)
    prompt_cache_size: int | None = _setting(
        -1, "Whole prompts kept in the exact prompt cache; -1 = auto (4 where paged prefix sharing cannot serve "
            "repeated prompts, else 0), 0 = off.", minimum=-1)
    prompt_cache_max_tokens: int | None = _setting(
        -1, "Longest prompt the exact prompt cache keeps; -1 = auto (2048 when the cache is on by default, "
            "else no limit), 0 = no limit.", minimum=-1)

    # Scheduler
    max_num_seqs: int | None = _setting(64, "Most requests running in one step.", minimum=1)
    max_num_batched_tokens: int | None = _setting(2048, "Token budget of one step (prefill chunks + decodes).",
                                                  minimum=1)
    scheduler_profile: str | None = _setting("throughput", "Named set of scheduler defaults.",
                                             choices=tuple(SCHEDULER_PROFILES))
    prefill_interval_steps: int | None = _setting(PROFILE, "Decode steps that may pass before waiting prefills are admitted.")
    scheduler_event_driven_prefill_insert: bool | None = _setting(
        PROFILE, "Admit waiting requests right after the current decode step instead of waiting for the interval.")
    skip_batch_wait_when_idle: bool | None = _setting(
        PROFILE, "When nothing runs, start a new request at once instead of waiting to coalesce a batch.")
    batch_wait_ms: float | None = _setting(PROFILE, "How long an idle engine waits to coalesce new requests into a batch.")
    long_prefill_token_threshold: int | None = _setting(
        PROFILE, "Most prompt tokens one request prefills in a step while others are decoding (the chunk size).")

    scheduler_token_sync_every_steps: int | None = _setting(
        0, "Non-streaming requests without stop strings, logprobs, penalties or grammars read their sampled "
           "tokens back from the device (and check EOS) every N steps, at the cost of up to N-1 discarded "
           "steps; 1 = every step; 0 = auto (8 on GPUs, 1 on CPU, where there is no device to wait for).")

    # Speculative decoding
    speculative_config: str | None = _setting(
        "", "Speculative decoding as a JSON object, as vLLM takes it: {\"method\": \"ngram\" | \"draft_model\" | "
            "\"mtp\", \"num_speculative_tokens\": K, ...} with prompt_lookup_min/prompt_lookup_max (ngram), model "
            "(draft_model: a directory, or anna-demo-draft for the demo model's own draft), disable_by_batch_size "
            "and min_acceptance_rate; empty = off.",
        parse=parse_speculative_config)

    # Warmup (serving)
    inference_warmup: bool | None = _setting(
        True, "Run the warmup shape table before serving (--no-inference-warmup skips it, for development).")
    warmup_prefill_tokens: int | None = _setting(0, "An extra prefill length for the warmup table; 0 = none.")
    warmup_batch_size: int | None = _setting(0, "An extra decode batch size for the warmup table; 0 = none.")
    warmup_decode_steps: int | None = _setting(8, "Decode steps run for each warmup shape.")

    # Compilation
    compile_mode: str | None = _setting(
        "auto", "torch.compile the model's forward pass; auto = what measured fastest on this device type "
                "(none on CPU, where Anna's fused decode kernels already skip torch's per-op overhead).",
        choices=("none", "auto", "default", "reduce-overhead", "max-autotune"))
    compile_fullgraph: bool | None = _setting(
        False, "Compile the forward pass as one graph (fails instead of splitting at code torch cannot trace).")
    decode_executor: str | None = _setting(
        "auto", "How a decode-only step runs. graph: one captured step (on CPU Anna's fused C decode stack; "
                "on CUDA a replayed CUDA graph per batch size and context bucket); eager: layer by layer; "
                "auto: graph where it measured faster (CPU), else eager.", choices=("auto", "eager", "graph"))
    torchinductor_cache_dir: str | None = _setting(
        "~/.anna/cache/torchinductor", "Persistent torch.compile cache, so that a restart reuses compiled "
        "kernels. A TORCHINDUCTOR_CACHE_DIR set by the user is used when this is not set.")

    # Structured output
    structured_output_cache_size: int | None = _setting(
        256, "Compiled grammars (JSON schemas, regexes, choices, tool-call grammars) kept for reuse.", minimum=1)
    structured_output_max_bytes: int | None = _setting(
        65536, "Largest schema, regex or grammar a request may send, in bytes.", minimum=1)

    # Server
    host: str | None = _setting("127.0.0.1", "Address the HTTP server listens on.")
    port: int | None = _setting(8000, "Port the HTTP server listens on.", maximum=65535)
    api_key: str | None = _setting(
        "", "If set, every route but /health needs 'Authorization: Bearer KEY' (or 'x-api-key: KEY', as Anthropic's "
            "clients send it).")
    allowed_origins: str | None = _setting(
        "*", "Comma-separated origins whose web pages may call the API (CORS); * = any, empty = none.")
    max_n: int | None = _setting(8, "Most parallel samples (n) one request may ask for.", minimum=1)
    max_request_bytes: int | None = _setting(
        16 * 1024 * 1024, "Largest request body the server reads, in bytes (16 MiB: a 128K-token prompt is well "
        "under 1 MiB); larger ones get 413.", minimum=1)
    header_read_timeout: float | None = _setting(
        30.0, "Seconds a connection may take to send a request's headers; then it gets 408 and is closed. 0 = no "
              "limit.")
    body_read_timeout: float | None = _setting(
        60.0, "Seconds a request may take to send its whole body; then it gets 408. 0 = no limit.")
    shutdown_timeout: float | None = _setting(
        20.0, "On SIGTERM or SIGINT: seconds requests in flight may take to finish (no new ones are accepted); "
              "those still running then end with an error (a final error event when streaming), and Anna exits 0.")
    prompt_workers: int | None = _setting(
        2, "Threads that render chat templates, tokenize prompts and compile grammars for generation requests.",
        minimum=1)
    tokenize_workers: int | None = _setting(
        1, "Threads that serve /tokenize and /detokenize, apart from generation's, so they cannot delay it.",
        minimum=1)
    text_queue_limit: int | None = _setting(
        32, "Jobs that may wait for each of those thread pools; a request beyond that gets 503 (server busy).")
    web_ui: bool | None = _setting(
        True, "Serve the web console at / (chat with the model, watch the engine live); its page loads without the "
              "API key and asks for it. --no-web-ui: / is a 404.")
    responses_store_size: int | None = _setting(
        256, "Responses (POST /v1/responses) kept in memory, the newest, so that a request may continue one by "
             "previous_response_id and GET /v1/responses/{id} may read it back; 0 = none kept (every request then "
             "carries its whole conversation). A request with store false is not kept.")
    tool_call_parser: str | None = _setting(
        "auto", "How tool calls are read from model output: hermes (JSON in <tool_call>, Qwen2.5/Qwen3), qwen3_xml "
                "or its alias qwen3_coder (<function=...><parameter=...> in <tool_call>, Qwen3.5/Qwen3-Coder), "
                "llama3_json (a JSON answer with name and parameters, Llama 3.1-3.3), mistral ([TOOL_CALLS]), none "
                "(calls only when forced, in a plain JSON form); auto = the format the chat template writes, "
                "none if it writes none.",
        choices=("auto", "hermes", "qwen3_xml", "qwen3_coder", "llama3_json", "mistral", "none"))
    reasoning_parser: str | None = _setting(
        "auto", "Split <think>...</think> reasoning into reasoning_content (also when the chat template opens "
                "<think> in the prompt, as Qwen3.5's does: the output then starts as reasoning); auto = think when "
                "the chat template has <think>, else none.",
        choices=("auto", "none", "think", "qwen3", "deepseek_r1"))
    log_level: str | None = _setting("info", "Logging level.", choices=("debug", "info", "warning", "error"))
    profile_runtime: bool | None = _setting(
        False, "Time every region of the forward pass (diagnosis only: it costs time, and turns off the fused "
               "CPU decode path); shown in the periodic stats line and at GET /debug/profile.")
    metrics_namespace: str | None = _setting(
        "both", "Metric name prefixes on /metrics: anna (anna:*), vllm (vLLM's vllm:* names, which its Grafana "
                "dashboards and autoscalers query, with its older aliases gpu_cache_usage_perc and "
                "time_per_output_token_seconds), or both.", choices=("both", "anna", "vllm"))
    log_stats_interval: float | None = _setting(
        10.0, "Seconds between the periodic engine stats log lines while serving; 0 = off.")

    def resolve(self, env: Mapping[str, str] | None = None, explicit_source: str = "cli") -> "ResolvedSettings":
        return resolve_settings(self, os.environ if env is None else env, explicit_source)


# Which component takes which settings: each is handed its section whole (ResolvedSettings.sections).
SECTION_FIELDS: dict[str, tuple[str, ...]] = {
    "model": ("model", "served_model_name", "tokenizer", "chat_template", "dtype", "seed", "generation_config",
              "cache_dir", "max_model_len", "weight_load_pipeline_workers", "quantization", "int4_group_size", "int8_group_size",
              "int4_cache_dir", "int4_cache_load_workers", "disable_int4_cache", "structured_output_cache_size",
              "structured_output_max_bytes"),
    "cache": ("block_size", "kv_cache_memory", "kv_cache_dtype", "num_gpu_blocks_override", "enable_prefix_caching",
              "memory_utilization", "min_free_memory_mib", "memory_release_sweep_interval_s",
              "memory_release_min_free_mib", "memory_release_max_gap_mib", "kv_release_chunk_blocks",
              "kv_commit_ahead_mib",
              "state_snapshots", "prompt_cache_size", "prompt_cache_max_tokens"),
    "scheduler": ("max_num_seqs", "max_num_batched_tokens", "scheduler_profile", "prefill_interval_steps",
                  "scheduler_event_driven_prefill_insert", "skip_batch_wait_when_idle", "batch_wait_ms",
                  "long_prefill_token_threshold", "scheduler_token_sync_every_steps", "speculative_config"),
    "execution": ("device", "compile_mode", "compile_fullgraph", "decode_executor", "torchinductor_cache_dir",
                  "profile_runtime", "inference_warmup", "warmup_prefill_tokens", "warmup_batch_size",
                  "warmup_decode_steps"),
    "parallel": ("tensor_parallel_size", "distributed_executor_backend", "nnodes", "node_rank", "master_addr",
                 "master_port"),
    "cpu": ("cpu_kernels", "cpu_kernel_compiler", "cpu_isa", "cpu_gemv_max_rows", "cpu_upcast_min_rows",
            "cpu_bf16_dot_min_rows", "cpu_bf16_pair_max_rows", "cpu_sdpa_min_tokens", "cpu_mlp_tile_rows",
            "calibrate", "cpu_huge_pages", "int4_matmul", "int4_gemv_m_threshold", "int8_gemv_m_threshold"),
    "server": ("host", "port", "api_key", "allowed_origins", "max_n", "max_request_bytes", "header_read_timeout",
               "body_read_timeout", "shutdown_timeout", "prompt_workers", "tokenize_workers", "text_queue_limit",
               "web_ui", "responses_store_size", "tool_call_parser", "reasoning_parser", "log_level", "metrics_namespace",
               "log_stats_interval"),
}


def _section_class(name: str) -> type:
    hints = typing.get_type_hints(ServeSettings)
    return dataclasses.make_dataclass(
        f"{name.capitalize()}Settings", [(f, hints[f]) for f in SECTION_FIELDS[name]], frozen=True,
        namespace={"__doc__": f"The resolved {name} settings (core/config.py, SECTION_FIELDS)."})


SECTION_CLASSES: dict[str, type] = {name: _section_class(name) for name in SECTION_FIELDS}


@dataclass(frozen=True)
class SettingsSections:
    """The resolved settings, grouped by the component that takes them."""

    model: Any
    cache: Any
    scheduler: Any
    execution: Any
    parallel: Any
    cpu: Any
    server: Any


@dataclass(frozen=True)
class ResolvedSettings:
    """ServeSettings with every field filled, and where each value came from."""

    values: ServeSettings
    sources: dict[str, str]

    def __getattr__(self, name: str) -> Any:  # settings.max_num_seqs reads through to the values
        return getattr(object.__getattribute__(self, "values"), name)

    @property
    def sections(self) -> SettingsSections:
        return SettingsSections(**{name: cls(**{f: getattr(self.values, f) for f in SECTION_FIELDS[name]})
                                   for name, cls in SECTION_CLASSES.items()})

    def with_value(self, name: str, value: Any, source: str) -> "ResolvedSettings":
        """The same settings with one value decided later (an ``auto`` resolved once the model's
        files are read), and where it came from."""
        return ResolvedSettings(dataclasses.replace(self.values, **{name: value}), {**self.sources, name: source})

    def rows(self) -> list[tuple[str, Any, str]]:
        """(name, value, source) of every setting, in declaration order; the API key's value shows
        only whether one is set."""
        return [(f.name, ("<set>" if self.values.api_key else "") if f.name == "api_key"
                 else getattr(self.values, f.name), self.sources[f.name]) for f in dataclasses.fields(ServeSettings)]

    def table(self) -> str:
        """One line per setting: name, value, source. Logged at start."""
        rows = [(name, repr(value), source) for name, value, source in self.rows()]
        width = max(len(r[0]) for r in rows)
        vwidth = max(len(r[1]) for r in rows)
        return "\n".join(f"  {n:<{width}}  {v:<{vwidth}}  ({s})" for n, v, s in rows)


def env_name(f: dataclasses.Field) -> str:
    return f.metadata.get("env") or ENV_PREFIX + f.name.upper()


def alias_names(f: dataclasses.Field) -> tuple[str, ...]:
    return f.metadata.get("aliases", ())


ALIASES: dict[str, str] = {alias: f.name for f in dataclasses.fields(ServeSettings) for alias in alias_names(f)}


def field_type(f: dataclasses.Field) -> type:
    """The non-None type of a field annotated ``X | None``."""
    hint = typing.get_type_hints(ServeSettings)[f.name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1:
        return args[0]
    return hint


def parse_value(f: dataclasses.Field, raw: Any, origin: str) -> Any:
    """Convert and check one value; raise ValueError naming the field."""
    typ = field_type(f)
    if f.metadata.get("parse") is not None:
        return f.metadata["parse"](raw)
    try:
        if typ is bool and isinstance(raw, str):
            low = raw.strip().lower()
            if low in ("1", "true", "yes", "on"):
                value: Any = True
            elif low in ("0", "false", "no", "off"):
                value = False
            else:
                raise ValueError(raw)
        elif typ is bool:
            if not isinstance(raw, bool):
                raise ValueError(raw)
            value = raw
        elif typ is int:
            if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
                raise ValueError(raw)
            value = int(raw)
        elif typ is float:
            if isinstance(raw, bool):
                raise ValueError(raw)
            value = float(raw)
        else:
            value = str(raw)
    except (TypeError, ValueError):
        raise ValueError(f"{f.name}: {raw!r} from {origin} is not a valid {typ.__name__}") from None
    choices = f.metadata.get("choices")
    if choices and value not in choices:
        raise ValueError(f"{f.name}: {value!r} from {origin} is not one of {', '.join(map(str, choices))}")
    if typ in (int, float) and value < f.metadata["minimum"]:
        raise ValueError(f"{f.name}: {value!r} from {origin} must be >= {f.metadata['minimum']}")
    if typ in (int, float) and f.metadata["maximum"] is not None and value > f.metadata["maximum"]:
        raise ValueError(f"{f.name}: {value!r} from {origin} must be <= {f.metadata['maximum']}")
    return value


def resolve_settings(settings: ServeSettings, env: Mapping[str, str], explicit_source: str = "cli") -> ResolvedSettings:
    """Fill every field: explicit value > ANNA_* env > another launcher's variable (MASTER_ADDR, ...) >
    scheduler profile > built-in default."""
    fields = dataclasses.fields(ServeSettings)
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    deferred = []
    for f in fields:
        explicit = getattr(settings, f.name)
        if explicit is not None:
            values[f.name], sources[f.name] = parse_value(f, explicit, "explicit value"), explicit_source
        elif env.get(env_name(f), "") != "":
            values[f.name], sources[f.name] = parse_value(f, env[env_name(f)], env_name(f)), "env"
        elif any(env.get(ENV_PREFIX + a.upper(), "") != "" for a in alias_names(f)):
            var = next(ENV_PREFIX + a.upper() for a in alias_names(f) if env.get(ENV_PREFIX + a.upper(), "") != "")
            values[f.name], sources[f.name] = parse_value(f, env[var], var), f"env {var}"
        elif any(env.get(var, "") != "" for var in f.metadata["env_fallbacks"]):
            var = next(var for var in f.metadata["env_fallbacks"] if env.get(var, "") != "")
            values[f.name], sources[f.name] = parse_value(f, env[var], var), f"env {var}"
        elif f.metadata["default"] is PROFILE:
            deferred.append(f)
        else:
            values[f.name], sources[f.name] = f.metadata["default"], "default"
    profile = SCHEDULER_PROFILES[values["scheduler_profile"]]
    for f in deferred:
        values[f.name], sources[f.name] = profile[f.name], "profile"
    user_inductor_dir = env.get("TORCHINDUCTOR_CACHE_DIR", "")
    if sources["torchinductor_cache_dir"] == "default" and user_inductor_dir \
            and user_inductor_dir != torch_default_inductor_dir():
        values["torchinductor_cache_dir"], sources["torchinductor_cache_dir"] = user_inductor_dir, \
            "env TORCHINDUCTOR_CACHE_DIR"
    if sources["cpu_kernel_compiler"] == "default" and env.get("CC", ""):
        values["cpu_kernel_compiler"], sources["cpu_kernel_compiler"] = env["CC"], "env CC"
    return ResolvedSettings(ServeSettings(**values), sources)


def torch_default_inductor_dir() -> str:
    """The temporary directory torch writes into TORCHINDUCTOR_CACHE_DIR when it imports its
    compiler: a value there that equals it was not set by the user."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return default_cache_dir()


def settings_fields() -> tuple[dataclasses.Field, ...]:
    return dataclasses.fields(ServeSettings)
