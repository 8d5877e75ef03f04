"""Why Anna's constrained decoding uses llguidance: it against outlines-core on one schema.

    pip install llguidance outlines-core
    python benchmarks/grammar_engines.py --tokenizer benchmarks/models/qwen2.5-0.5b-tok32k

For each engine: the time to get ready for a new schema (compile) and the time of one token mask,
mean and max over the tokens of a document that follows the schema.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer

SCHEMA = {"type": "object", "required": ["name", "age", "tags", "address", "kind"],
          "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"},
                         "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
                         "address": {"type": "object", "required": ["city", "zip"],
                                     "properties": {"city": {"type": "string"},
                                                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}},
                         "kind": {"enum": ["a", "b", "c"]}}}
DOCUMENT = {"name": "Ada Lovelace", "age": 36, "tags": ["math", "poetry"],
            "address": {"city": "London", "zip": "12345"}, "kind": "b"}


def byte_decoder() -> dict[str, int]:
    """GPT-2's byte-to-unicode table, inverted: the bytes behind a byte-level BPE token's text."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def run_llguidance(tok: Tokenizer, eos: int, ids: list[int]) -> dict:
    import llguidance

    t0 = time.perf_counter()
    lltok = llguidance.LLTokenizer(tok.to_str(), eos_token=eos)
    trie = time.perf_counter() - t0
    t0 = time.perf_counter()
    matcher = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_json_schema(SCHEMA), log_level=0)
    compile_s = time.perf_counter() - t0
    mask = torch.zeros((tok.get_vocab_size() + 31) // 32, dtype=torch.int32)
    times = []
    for t in ids:
        t0 = time.perf_counter()
        matcher.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * 4)
        times.append(time.perf_counter() - t0)
        assert matcher.consume_token(t), matcher.get_error()
    return {"vocabulary_ms": 1e3 * trie, "compile_ms": 1e3 * compile_s, "mask_us_mean": 1e6 * statistics.mean(times),
            "mask_us_max": 1e6 * max(times), "accepts_document": matcher.is_accepting()}


def run_outlines_core(tok: Tokenizer, eos: int, ids: list[int]) -> dict:
    import outlines_core

    dec = byte_decoder()
    vocab: dict[bytes, list[int]] = {}
    for text, i in tok.get_vocab().items():
        if i != eos and all(c in dec for c in text):
            vocab.setdefault(bytes(dec[c] for c in text), []).append(i)
    t0 = time.perf_counter()
    vocabulary = outlines_core.Vocabulary(eos, vocab)
    vocab_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    regex = outlines_core.json_schema.build_regex_from_schema(json.dumps(SCHEMA))
    guide = outlines_core.Guide(outlines_core.Index(regex, vocabulary))
    compile_s = time.perf_counter() - t0
    mask = torch.zeros((tok.get_vocab_size() + 31) // 32, dtype=torch.int32)
    times = []
    for t in ids:
        t0 = time.perf_counter()
        guide.write_mask_into(mask.data_ptr(), mask.numel(), 4)
        times.append(time.perf_counter() - t0)
        guide.advance(t)
    return {"vocabulary_ms": 1e3 * vocab_s, "compile_ms": 1e3 * compile_s, "mask_us_mean": 1e6 * statistics.mean(times),
            "mask_us_max": 1e6 * max(times), "accepts_document": guide.is_finished()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", type=Path, required=True, help="A directory with tokenizer.json.")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/grammar_engines.json"))
    args = ap.parse_args()
    tok = Tokenizer.from_file(str(args.tokenizer / "tokenizer.json"))
    eos = tok.token_to_id("<|im_end|>")
    ids = tok.encode(json.dumps(DOCUMENT)).ids
    results = {"tokenizer_vocab": tok.get_vocab_size(), "document_tokens": len(ids),
               "llguidance": run_llguidance(tok, eos, ids), "outlines_core": run_outlines_core(tok, eos, ids)}
    print(json.dumps(results, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
