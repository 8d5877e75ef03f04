"""Result files (one JSON per run), the markdown comparison of several runs, and optional plots."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from anna.bench.stats import RequestRecord, evaluate_targets

DEFINITIONS = {
    "decode_tok_s": "(completion_tokens - 1) / (time of last chunk - time of first chunk); affected by SSE "
                    "coalescing and multi-token commits, not the kernel throughput",
    "group_throughput_tok_s": "all completion tokens of the group / wall time of the group (prefill included)",
    "ttft_s": "time to the first non-empty token, reasoning included",
    "ttfc_s": "time to the first non-empty content token, reasoning excluded",
    "prefix_cache_delta": "change of the server's prefix-cache query/hit counters (tokens) over the scenario, "
                          "read from /metrics; null when the server exposes none",
    "spec_decode_delta": "change of the server's speculative-decoding counters over the scenario (drafts, draft "
                         "tokens, accepted tokens) and the acceptance rate they give, read from /metrics; null "
                         "when the server exposes none",
    "weighted_throughput": "Output TPS x 16.796 + Input TPS x 2.799 + Cache TPS x 0.56",
}
RANDOM_MODEL_NOTE = ("Some checks failed. With a random-weight model this is expected (its text is meaningless); "
                     "the timings are still valid.")


def record_dict(r: RequestRecord) -> dict[str, Any]:
    return {"scenario": r.scenario, "ok": r.ok, "error": r.error, "prompt_tokens": r.prompt_tokens,
            "completion_tokens": r.completion_tokens, "cached_tokens": r.cached_tokens, "ttft_s": r.ttft,
            "ttfc_s": r.ttfc, "completion_time_s": r.completion_time, "decode_tok_s": r.decode_tok_s,
            "finish_reason": r.finish_reason, "output_hash": r.output_hash, "check": r.check}


def _mean(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.fmean(vals) if vals else None


def suite_result(label: str, info: dict, settings: dict, scenarios: list[dict]) -> dict[str, Any]:
    out = []
    for sc in scenarios:
        recs = sc["records"]
        out.append({
            "name": sc["name"], "wall_s": sc["wall_s"], "group_throughput_tok_s": sc["group_throughput_tok_s"],
            "prefix_cache_delta": sc["prefix_cache_delta"], "spec_decode_delta": sc.get("spec_decode_delta"),
            "concurrency": sc.get("concurrency", 1),
            "long_context": sc.get("long_context"), "mean_ttft_s": _mean([r.ttft for r in recs]),
            "mean_decode_tok_s": _mean([r.decode_tok_s for r in recs]),
            "checks_passed": sum(r.check == "pass" for r in recs), "checks": len(recs),
            "records": [record_dict(r) for r in recs]})
    all_checks = [c for sc in out for c in (sc["checks_passed"], sc["checks"])]
    failed = any(sc["checks_passed"] < sc["checks"] for sc in out)
    return {"label": label, "mode": "suite", "server": info, "settings": settings, "definitions": DEFINITIONS,
            "scenarios": out, "note": RANDOM_MODEL_NOTE if failed else "All checks passed.",
            "checks_total": sum(all_checks[1::2])}


def load_result(label: str, info: dict, settings: dict, load: dict, targets: dict) -> dict[str, Any]:
    summary = load["summary"]
    return {"label": label, "mode": "load", "server": info, "settings": settings, "definitions": DEFINITIONS,
            "summary": summary, "targets": targets, "pass": evaluate_targets(summary, targets),
            "records": [record_dict(r) for r in load["records"]]}


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def compare_markdown(results: list[dict]) -> str:
    """One table, a column per result file, a row per metric."""
    rows: dict[str, list[str]] = {}

    def put(key: str, i: int, value: Any) -> None:
        rows.setdefault(key, ["-"] * len(results))[i] = _fmt(value)

    for i, res in enumerate(results):
        if res["mode"] == "suite":
            for sc in res["scenarios"]:
                put(f"{sc['name']}: mean TTFT s", i, sc["mean_ttft_s"])
                put(f"{sc['name']}: mean decode tok/s", i, sc["mean_decode_tok_s"])
                if sc.get("concurrency", 1) > 1:
                    put(f"{sc['name']}: group throughput tok/s", i, sc["group_throughput_tok_s"])
                put(f"{sc['name']}: checks passed", i, f"{sc['checks_passed']}/{sc['checks']}")
                delta = sc["prefix_cache_delta"]
                put(f"{sc['name']}: prefix cache hits/queries", i,
                    None if delta is None else f"{delta['hits']:.0f}/{delta['queries']:.0f}")
                spec = sc.get("spec_decode_delta")
                if spec is not None and spec["draft_tokens"]:
                    put(f"{sc['name']}: speculative acceptance rate", i, spec["acceptance_rate"])
        else:
            for key, value in res["summary"].items():
                if not isinstance(value, dict):
                    put(key, i, value)
            for key, ok in res["pass"].items():
                put(f"target {key}", i, "pass" if ok else "fail")
    header = "| metric | " + " | ".join(r["label"] for r in results) + " |"
    sep = "|---|" + "---|" * len(results)
    return "\n".join([header, sep] + [f"| {k} | " + " | ".join(v) + " |" for k, v in rows.items()]) + "\n"


def write_plots(results: list[dict], outdir: Path) -> list[Path]:
    """TTFT distribution, per-request decode speed, throughput vs concurrency (needs matplotlib)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    outdir.mkdir(parents=True, exist_ok=True)
    paths = []

    def records(res: dict) -> list[dict]:
        return res["records"] if res["mode"] == "load" else [r for sc in res["scenarios"] for r in sc["records"]]

    for key, title, fname in (("ttft_s", "Time to first token (s)", "ttft.png"),
                              ("decode_tok_s", "Per-request decode tok/s", "decode_speed.png")):
        fig, ax = plt.subplots(figsize=(7, 4))
        for res in results:
            vals = [r[key] for r in records(res) if r[key] is not None]
            if vals:
                ax.hist(vals, bins=20, alpha=0.6, label=res["label"])
        ax.set_title(title)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
        fig.savefig(outdir / fname, dpi=100)
        plt.close(fig)
        paths.append(outdir / fname)
    fig, ax = plt.subplots(figsize=(7, 4))
    for res in results:
        if res["mode"] == "suite":
            pts = sorted((sc.get("concurrency", 1), sc["group_throughput_tok_s"]) for sc in res["scenarios"]
                         if sc["name"].startswith("explanations") and sc["group_throughput_tok_s"])
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=res["label"])
    ax.set_xlabel("concurrency")
    ax.set_ylabel("output tok/s")
    ax.set_title("Throughput vs concurrency")
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    fig.savefig(outdir / "throughput.png", dpi=100)
    plt.close(fig)
    paths.append(outdir / "throughput.png")
    return paths


def save(result: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n")
