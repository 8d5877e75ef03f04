"""GET /snapshot: the engine at this moment as one small JSON, what the web console polls every
second and what scripts may read (docs/console.md lists the fields). Every figure comes from
LLMEngine.snapshot() and the resolved settings; counters are totals since start (after warmup),
so a reader takes rates from two readings: (b.tokens.generation - a.tokens.generation) /
(b.time - a.time)."""

from __future__ import annotations

import time
from typing import Any

from fastapi.responses import JSONResponse, Response

from anna.runtime.metrics import StepClass
from anna.server.common import ServerState


def snapshot_json(state: ServerState) -> dict[str, Any]:
    engine = state.core  # a 503 while the model loads
    snap = engine.snapshot()
    stats = snap.stats
    steps = stats.steps
    settings = engine.settings
    return {
        "time": time.time(),
        "model": state.model_name,
        "started": state.created,
        "requests": {"running": snap.num_running, "waiting": snap.num_waiting,
                     "finished": sum(stats.finished.values()), "aborted": stats.aborted,
                     "failed": sum(stats.failed.values()), "preemptions": snap.num_preemptions},
        "tokens": {"prompt": stats.prompt_tokens, "generation": stats.generation_tokens},
        "kv_cache": {"blocks": snap.num_blocks, "used": snap.num_blocks - snap.num_free_blocks,
                     "cached": snap.num_cached_blocks, "usage": snap.kv_usage,
                     "block_size": engine.kv.block_size},
        "prefix_cache": {"queried_tokens": snap.prefix_cache_queries, "hit_tokens": snap.prefix_cache_hits,
                         "hit_rate": snap.prefix_cache_hits / snap.prefix_cache_queries
                         if snap.prefix_cache_queries else None},
        "prompt_cache": {"entries": snap.prompt_cache_size, "lookups": snap.prompt_cache_lookups,
                         "hits": snap.prompt_cache_hits},
        "steps": {"total": snap.num_steps, "failed": stats.failed_steps, "spikes": steps.spikes,
                  "classes": {c.value: {"count": steps.counts[c],
                                        "mean_ms": steps.ewma[c] * 1e3 if c in steps.ewma else None}
                              for c in StepClass}},
        "memory": {"kv_resident_bytes": snap.kv_resident_bytes, "releases": snap.memory_releases},
        "speculative": {"drafts": stats.spec.num_drafts, "draft_tokens": stats.spec.num_draft_tokens,
                        "accepted_tokens": stats.spec.num_accepted_tokens},
        "settings": [{"name": name, "value": value, "source": source} for name, value, source in settings.rows()],
    }


def serve_snapshot(state: ServerState) -> Response:
    return JSONResponse(snapshot_json(state))
