"""Serve a GGUF file (llama.cpp's format): its metadata becomes a Hugging Face-shaped model
directory, its tensors load under Hugging Face names.

``prepare_gguf_model`` writes config.json, generation_config.json and (for byte-level BPE
vocabularies) tokenizer.json and tokenizer_config.json, built from the file's metadata, into
``{cache_dir}/gguf/<key>/`` beside a link to the file, so that everything downstream (config,
tokenizer, chat template, loader, int4 layout cache) reads it as any other model directory. The
key covers the file's path, size and modification time and this module's format version.

Tensors (``GGUFTensors``): F32/F16/BF16 load as they are; Q4_0 (an fp16 scale and 32 signed
4-bit values per block, low nibble = value i, high nibble = value i + 16) is Anna's int4 at
group 32 byte for byte, and Q8_0 (an fp16 scale and 32 int8 values) Anna's int8 at group 32, so
they become ``PackedWeight``s that a layer of that format takes without a float round trip;
every other type (the K-quants, ...) is dequantized by the ``gguf`` package and quantized again
by the layer into the format Anna serves (``quant_choice`` picks it from the file's types and the
log says which tensors took which way). llama.cpp stores a Llama model's
q/k rows permuted for its rotary; they are put back in Hugging Face's order.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from anna.model.config import ModelLoadError
from anna.model.quantization import PackedWeight, dense
from anna.weights.gguf_file import GGUFFile

log = logging.getLogger(__name__)

FORMAT_VERSION = 2  # of the derived directory: bump when what is written there changes
LINK_NAME = "model.gguf"
GGUF_TYPES_KEY = "gguf_matrix_types"  # in the derived config.json: elements per tensor type
GGUF_LM_HEAD_KEY = "gguf_lm_head_type"  # and the type of the lm_head (the embedding's where tied)

# general.architecture -> (Hugging Face architecture, model_type)
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    "qwen35": ("Qwen3_5ForCausalLM", "qwen3_5_text"),
    "qwen35moe": ("Qwen3_5MoeForCausalLM", "qwen3_5_moe_text"),
}
HYBRID = ("qwen35", "qwen35moe")  # Gated DeltaNet layers beside full attention (model/qwen3_5.py)
TOP_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
LAYER_TENSORS = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj", "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj", "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    # the hybrid family: its post-attention norm's name, and the Gated DeltaNet layers' tensors
    "post_attention_norm": "post_attention_layernorm", "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z", "ssm_beta": "linear_attn.in_proj_b", "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_a": "linear_attn.A_log", "ssm_dt": "linear_attn.dt", "ssm_conv1d": "linear_attn.conv1d",
    "ssm_norm": "linear_attn.norm", "ssm_out": "linear_attn.out_proj",
}
# llama.cpp's converter stores the hybrid family's zero-centred norms as 1 + w (Gated DeltaNet's own
# norm excepted), A_log as -exp(A_log) and dt_bias as ssm_dt.bias
PLUS_ONE_NORMS = ("attn_norm", "post_attention_norm", "attn_q_norm", "attn_k_norm", "output_norm")
EXPERT_TENSORS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}

# tokenizer.ggml.pre (llama.cpp's names) -> the split before byte-level BPE (None: GPT-2's, built
# into ByteLevel). Others, llama.cpp's "default" among them, need the original tokenizer (--tokenizer).
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS = {
    "gpt-2": None,
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
             r"|\s+(?!\S)|\s+",
    "llama-bpe": _LLAMA3, "llama3": _LLAMA3, "llama-v3": _LLAMA3,
}
IGNORE_MERGES = {"llama-bpe", "llama3", "llama-v3"}  # whole words in the vocabulary skip the merges (llama.cpp's Llama 3)
TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED = 3, 4, 5  # tokenizer.ggml.token_type values


def _gguf():
    try:
        import gguf
    except ImportError:  # a dependency of Anna; only missing from a broken install
        raise ModelLoadError("reading GGUF files needs the gguf package (pip install gguf)") from None
    return gguf


def find_gguf(path: str | Path) -> Path | None:
    """The GGUF file that ``path`` names: the file itself, or the one .gguf in a directory
    without safetensors (None when ``path`` is not a GGUF model)."""
    path = Path(path)
    if path.is_file():
        return path if path.suffix == ".gguf" else None
    if not path.is_dir() or any(path.glob("*.safetensors")):
        return None
    files = sorted(path.glob("*.gguf"))
    if len(files) > 1:
        raise ModelLoadError(f"{path}: holds {len(files)} GGUF files ({', '.join(f.name for f in files)}); "
                             "name the one to serve")
    return files[0] if files else None


def open_reader(path: Path) -> GGUFFile:
    _gguf()
    reader = GGUFFile(path)
    if int(reader.field("split.count", 1) or 1) > 1:
        raise ModelLoadError(f"{path}: one part of a split GGUF; join the parts first (llama-gguf-split --merge)")
    return reader


def _architecture(reader: GGUFFile, path: Path) -> str:
    arch = reader.field("general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelLoadError(f"{path}: GGUF architecture {arch!r} is not served; Anna serves GGUF files of "
                             f"{', '.join(sorted(ARCHITECTURES))}")
    return arch


# ---- which format Anna serves a GGUF in ----

INT4_SOURCES = {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "IQ4_NL", "IQ4_XS", "IQ3_S",
                "IQ3_XXS", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M", "TQ1_0", "TQ2_0", "MXFP4"}
INT8_SOURCES = {"Q8_0", "Q6_K"}
FLOAT_SOURCES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
EXACT = {"Q4_0": "int4", "Q8_0": "int8"}  # types that are one of Anna's formats at group 32


@dataclass(frozen=True)
class QuantChoice:
    method: str  # none | int8 | int4: what quantization=auto means for this file
    group: int  # of int4 or int8: 32, Q4_0's and Q8_0's own
    why: str


def quant_choice(types: Counter) -> QuantChoice:
    """From the element count of each type among the matrices: 4-bit-or-less types -> int4 at
    group 32 (Q4_0's own), 8- and 6-bit ones -> int8 at group 32 (Q8_0's), float -> none."""
    classes: Counter = Counter()
    for name, count in types.items():
        classes[_method_of(name)] += count
    method = classes.most_common(1)[0][0] if classes else "none"
    main = max((t for t in types if _method_of(t) == method), key=lambda t: types[t], default="F16")
    return QuantChoice(method, 32, f"the GGUF's matrices are mostly {main}")


def lm_head_method(config: dict[str, Any]) -> str:
    """The lm_head's method, from the type the file stores it in (llama-quantize keeps it in 6 or
    8 bits where the layers have 4)."""
    return _method_of(config.get(GGUF_LM_HEAD_KEY, "F16"))


def _method_of(type_name: str) -> str:
    return "int4" if type_name in INT4_SOURCES else "int8" if type_name in INT8_SOURCES else "none"


def describe_conversion(types: Counter, method: str, group: int, lm_head: tuple[str, str, int] | None = None) -> list[str]:
    """One line per tensor type: how its tensors reach the format Anna serves (``method`` at
    ``group``), and one for the lm_head where it has a format of its own (its GGUF type, method
    and group; see ``lm_head_method``)."""
    types = Counter(types)
    if lm_head is not None:
        types[lm_head[0]] -= 1
    lines = [f"GGUF {name}: {count} tensor(s) {_how(name, method, group)}"
             for name, count in sorted(types.items()) if count > 0]
    if lm_head is not None:
        lines.append(f"GGUF {lm_head[0]}: the lm_head {_how(*lm_head)}")
    return lines


def _how(type_name: str, method: str, group: int) -> str:
    where = f"Anna's {method} ({f'group {group}' if group else 'one scale per row'})"
    if EXACT.get(type_name) == method and group == 32:
        return f"repacked into {where} as it is stored"
    if type_name in FLOAT_SOURCES or method == "none":
        return "loaded as floats" if type_name in FLOAT_SOURCES else "dequantized at load to floats"
    return f"dequantized at load and quantized again to {where}"


def matrix_types(reader: GGUFFile) -> Counter:
    """Elements per tensor type among the file's matrices (the embedding excluded: it is a lookup)."""
    types: Counter = Counter()
    for t in reader.tensors:
        if len(t.shape) >= 2 and not t.name.startswith("token_embd"):
            types[t.type_name] += t.n_elements
    return types


# ---- the derived model directory ----

def prepare_gguf_model(path: Path, cache_dir: str | Path, need_tokenizer: bool = True) -> Path:
    """A model directory for the GGUF file ``path`` (written once per file version). Without
    ``need_tokenizer`` (a --tokenizer directory is given) a vocabulary Anna cannot rebuild is no error."""
    path = path.resolve()
    st = path.stat()
    key = hashlib.sha256(json.dumps([FORMAT_VERSION, str(path), st.st_size, st.st_mtime_ns]).encode()).hexdigest()[:20]
    out = Path(cache_dir).expanduser() / "gguf" / key
    if (out / "config.json").exists() and (not need_tokenizer or (out / "tokenizer.json").exists()):
        return out
    reader = open_reader(path)
    arch = _architecture(reader, path)
    out.mkdir(parents=True, exist_ok=True)
    config, generation = hf_config(reader, arch, path)
    try:
        tokenizer_json, tokenizer_config = gguf_tokenizer(reader, path)
    except ModelLoadError:
        if need_tokenizer:
            raise
        tokenizer_json, tokenizer_config = None, {}
    files = {"config.json": json.dumps(config, indent=1), "generation_config.json": json.dumps(generation, indent=1)}
    if tokenizer_json is not None:
        files["tokenizer.json"] = tokenizer_json
        files["tokenizer_config.json"] = json.dumps(tokenizer_config, indent=1)
    for name, text in files.items():
        tmp = out / f".{name}.tmp"
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, out / name)  # each file appears whole
    link = out / LINK_NAME
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(path)
    log.info("GGUF %s (%s): model directory %s", path.name, arch, out)
    return out


def hf_config(reader: GGUFFile, arch: str, path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """config.json and generation_config.json for the file, from its metadata."""
    def meta(key: str, default: Any = None) -> Any:
        return reader.field(f"{arch}.{key}", default)

    def need(key: str) -> Any:
        value = meta(key)
        if value is None:
            raise ModelLoadError(f"{path}: GGUF metadata {arch}.{key} is missing")
        return value

    names = {t.name for t in reader.tensors}
    embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embd is None:
        raise ModelLoadError(f"{path}: GGUF has no token_embd.weight tensor")
    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    hf_arch, model_type = ARCHITECTURES[arch]
    floats = Counter(t.type_name for t in reader.tensors if len(t.shape) >= 2 and t.type_name in FLOAT_SOURCES)
    config: dict[str, Any] = {
        "architectures": [hf_arch], "model_type": model_type, "vocab_size": int(embd.shape[1]),
        "hidden_size": hidden, "intermediate_size": int(meta("feed_forward_length", 0) or 0),
        "num_hidden_layers": int(need("block_count")), "num_attention_heads": heads,
        "num_key_value_heads": int(meta("attention.head_count_kv", heads)),
        "head_dim": int(meta("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(meta("context_length", 2048)),
        "rope_theta": float(meta("rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in names, "use_sliding_window": False,
        # matrices left in floats keep their type; a quantized file's leftovers (norms) take bf16
        "torch_dtype": FLOAT_SOURCES[floats.most_common(1)[0][0]] if floats else "bfloat16",
        "bos_token_id": reader.field("tokenizer.ggml.bos_token_id"),
        "eos_token_id": reader.field("tokenizer.ggml.eos_token_id"),
        GGUF_TYPES_KEY: dict(matrix_types(reader)),  # what quantization=auto is chosen from
        GGUF_LM_HEAD_KEY: next(t for t in reader.tensors if t.name == (
            "output.weight" if "output.weight" in names else "token_embd.weight")).type_name,
    }
    if meta("expert_count"):
        config.update(num_experts=int(meta("expert_count")), num_experts_per_tok=int(need("expert_used_count")),
                      moe_intermediate_size=int(need("expert_feed_forward_length")), decoder_sparse_step=1,
                      norm_topk_prob=arch == "qwen3moe",
                      shared_expert_intermediate_size=int(meta("expert_shared_feed_forward_length", 0) or 0))
        config["intermediate_size"] = config["intermediate_size"] or config["moe_intermediate_size"]
    if arch in HYBRID:
        config.update(_hybrid_config(meta, need, config))
    scaling = meta("rope.scaling.type")
    if scaling in ("linear", "yarn"):
        config["rope_scaling"] = {"rope_type": scaling, "factor": float(need("rope.scaling.factor")),
                                  **({"original_max_position_embeddings": int(meta("rope.scaling.original_context_length"))}
                                     if meta("rope.scaling.original_context_length") else {})}
    elif scaling not in (None, "none"):
        raise ModelLoadError(f"{path}: GGUF rope scaling {scaling!r} is not supported (linear and yarn are)")
    if "rope_freqs.weight" in names:
        config["rope_scaling"] = _llama3_rope_scaling(reader, config, path)
    eos = [i for i in (reader.field(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")) if i is not None]
    generation = {"eos_token_id": list(dict.fromkeys(eos)), "bos_token_id": config["bos_token_id"]}
    return config, generation


def _hybrid_config(meta, need, config: dict[str, Any]) -> dict[str, Any]:
    """Qwen3.5's Gated DeltaNet shapes (ssm.*), its layer types, partial rotary, and the
    multi-token-prediction blocks that llama.cpp counts in block_count (not loaded here)."""
    value_heads = int(need("ssm.time_step_rank"))
    layers = int(need("block_count")) - int(meta("nextn_predict_layers", 0) or 0)
    recurrent = meta("attention.recurrent_layers")
    if recurrent is None:
        interval = int(meta("full_attention_interval", 4))
        recurrent = [(i + 1) % interval != 0 for i in range(layers)]
    return {"num_hidden_layers": layers, "layer_types": ["linear_attention" if r else "full_attention"
                                                         for r in recurrent[:layers]],
            "linear_num_key_heads": int(need("ssm.group_count")), "linear_num_value_heads": value_heads,
            "linear_key_head_dim": int(need("ssm.state_size")),
            "linear_value_head_dim": int(need("ssm.inner_size")) // value_heads,
            "linear_conv_kernel_dim": int(need("ssm.conv_kernel")),
            "partial_rotary_factor": int(meta("rope.dimension_count", config["head_dim"])) / config["head_dim"]}


def _llama3_rope_scaling(reader: Any, config: dict[str, Any], path: Path) -> dict[str, Any]:
    """llama.cpp stores Llama 3.1's rotary scaling as per-frequency factors (rope_freqs.weight),
    not as its parameters. Those are Meta's (low 1, high 4, 8,192 original positions; the factor
    the largest of them) in every release: accept the file when they reproduce its factors."""
    factors = next(t for t in reader.tensors if t.name == "rope_freqs.weight").data.astype(np.float64)
    params = {"rope_type": "llama3", "factor": float(factors.max()), "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
    dim, base = config["head_dim"], config["rope_theta"]
    freqs = 1.0 / base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    wavelen = 2 * np.pi / freqs
    low_wl, high_wl = 8192 / params["low_freq_factor"], 8192 / params["high_freq_factor"]
    smooth = (8192 / wavelen - params["low_freq_factor"]) / (params["high_freq_factor"] - params["low_freq_factor"])
    expected = np.where(wavelen < high_wl, 1.0, np.where(wavelen > low_wl, params["factor"],
                                                         1.0 / ((1 - smooth) / params["factor"] + smooth)))
    if factors.shape != expected.shape or not np.allclose(factors, expected, rtol=1e-4):
        raise ModelLoadError(f"{path}: rope_freqs.weight holds rotary factors that are not Llama 3's scaling")
    return params


def gguf_tokenizer(reader: GGUFFile, path: Path) -> tuple[str, dict[str, Any]]:
    """tokenizer.json text and tokenizer_config.json from a byte-level BPE vocabulary
    (tokenizer.ggml.model "gpt2": Qwen, Llama 3 and most recent models)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    model = reader.field("tokenizer.ggml.model")
    pre = reader.field("tokenizer.ggml.pre") or "(none)"
    if model != "gpt2":
        raise ModelLoadError(f"{path}: GGUF vocabulary type {model!r} cannot be rebuilt by Anna (byte-level BPE, "
                             "'gpt2', can); pass the original model's tokenizer directory with --tokenizer")
    if pre not in PRE_TOKENIZERS:
        raise ModelLoadError(f"{path}: GGUF pre-tokenizer {pre!r} is not known to Anna (known: "
                             f"{', '.join(sorted(PRE_TOKENIZERS))}); pass the original tokenizer with --tokenizer")
    tokens = reader.field("tokenizer.ggml.tokens")
    types = reader.field("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in reader.field("tokenizer.ggml.merges", [])]
    # every token in the model's vocabulary (as Hugging Face's Qwen and Llama 3 files hold them), so
    # that the added tokens below keep their ids wherever they sit
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=pre in IGNORE_MERGES))
    pattern = PRE_TOKENIZERS[pre]
    if pattern is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    added = [(i, AddedToken(tokens[i], special=types[i] == TOKEN_CONTROL, normalized=False))
             for i in range(len(tokens)) if types[i] in (TOKEN_CONTROL, TOKEN_USER_DEFINED)]
    for i, added_token in added:
        tok.add_special_tokens([added_token]) if added_token.special else tok.add_tokens([added_token])
        if tok.token_to_id(tokens[i]) != i:
            raise ModelLoadError(f"{path}: GGUF vocabulary: token {i} ({tokens[i]!r}) does not keep its id when "
                                 "rebuilt; pass the original tokenizer with --tokenizer")

    def text(key: str) -> str | None:
        i = reader.field(f"tokenizer.ggml.{key}_token_id")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    bos = text("bos")
    if reader.field("tokenizer.ggml.add_bos_token", False) and bos is not None:
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, tokens.index(bos))])
    config = {"bos_token": bos, "eos_token": text("eos"), "pad_token": text("padding"),
              "chat_template": reader.field("tokenizer.chat_template")}
    return tok.to_str(), {k: v for k, v in config.items() if v is not None}


# ---- tensors ----

class GGUFTensors:
    """The file's tensors under Hugging Face names, as ``CausalLM.load_weights`` takes them."""

    def __init__(self, path: Path, config: dict[str, Any]) -> None:
        self.path = path
        self.reader = open_reader(path)
        self.arch = _architecture(self.reader, path)
        self.config = config
        self.types: Counter = Counter(t.type_name for t in self.reader.tensors)
        self.skipped: list[str] = []

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor | PackedWeight]]:
        layers = self.config["num_hidden_layers"]
        for t in self.reader.tensors:
            base, _, kind = t.name.rpartition(".")
            if kind not in ("weight", "bias"):  # (ssm_a has no suffix)
                base, kind = t.name, ""
            parts = base.split(".")
            in_layer = parts[0] == "blk" and len(parts) == 3 and int(parts[1]) < layers
            if in_layer and parts[2] in EXPERT_TENSORS:
                for e, value in enumerate(self._experts(t)):
                    yield f"model.layers.{parts[1]}.mlp.experts.{e}.{EXPERT_TENSORS[parts[2]]}.{kind}", value
                continue
            if in_layer and parts[2] in LAYER_TENSORS:
                name = f"model.layers.{parts[1]}.{LAYER_TENSORS[parts[2]]}"
            elif base in TOP_TENSORS:
                name = TOP_TENSORS[base]
            else:  # rope_freqs (read into the config), multi-token-prediction blocks, unknown names
                self.skipped.append(t.name)
                continue
            value = self._tensor(t)
            if self.arch == "llama" and parts[-1] in ("attn_q", "attn_k"):
                value = _unpermute_rotary(value, self.config["num_attention_heads"] if parts[-1] == "attn_q"
                                          else self.config["num_key_value_heads"])
            if parts[-1] == "ffn_gate_inp_shexp":  # [hidden] in GGUF, one output row in the model
                value = value.reshape(1, -1)
            if self.arch in HYBRID:
                name, kind, value = _from_hybrid_layout(parts[-1], name, kind, value, self.config)
            yield f"{name}.{kind}" if kind else name, value

    def _tensor(self, t: Any) -> torch.Tensor | PackedWeight:
        return _convert(t.data, t.type_name, self.path, t.name)

    def _experts(self, t: Any) -> Iterator[torch.Tensor | PackedWeight]:
        data = t.data  # [experts, rows, ...]: one matrix each
        for e in range(data.shape[0]):
            yield _convert(data[e], t.type_name, self.path, t.name)


def _convert(data: np.ndarray, qtype: str, path: Path, name: str) -> torch.Tensor | PackedWeight:
    """One tensor's data (as the gguf reader maps it) -> a tensor, or Q4_0 as Anna's packed int4."""
    if qtype in ("F32", "F16"):
        return torch.from_numpy(np.array(data))
    if qtype == "BF16":
        raw = np.array(data)
        return torch.from_numpy(raw).view(torch.bfloat16).reshape(*raw.shape[:-1], raw.shape[-1] // 2)
    if qtype in EXACT:  # blocks of an fp16 scale and 32 values: 16 bytes of nibbles (Q4_0) or 32 int8 (Q8_0)
        method = EXACT[qtype]
        blocks = torch.from_numpy(np.array(data)).view(*data.shape[:-1], -1, 18 if method == "int4" else 34)
        rows = int(np.prod(data.shape[:-1]))
        scales = blocks[..., :2].contiguous().view(torch.float16).reshape(rows, -1)
        values = blocks[..., 2:].reshape(rows, -1).contiguous()
        return PackedWeight(method, values if method == "int4" else values.view(torch.int8), scales, 32)
    gguf = _gguf()
    try:
        values = gguf.quants.dequantize(np.array(data), gguf.GGMLQuantizationType[qtype])
    except (NotImplementedError, KeyError) as exc:
        raise ModelLoadError(f"{path}: tensor {name} has GGUF type {qtype}, which Anna cannot read ({exc})") from None
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))


def _from_hybrid_layout(part: str, name: str, kind: str, value: torch.Tensor | PackedWeight,
                        cfg: dict[str, Any]) -> tuple[str, str, torch.Tensor | PackedWeight]:
    """Undo what llama.cpp's converter does to Qwen3.5's tensors: norms stored as 1 + w, A_log as
    -exp(A_log), dt_bias as ssm_dt.bias, the conv kernel squeezed, and, where value heads
    outnumber key heads, the value heads reordered from grouped by key head ([k0: v0 v1, k1: v0
    v1]) to tiled ([v0: k0 k1, v1: k0 k1]) in every tensor that has one row or column per value
    head channel."""
    if part in PLUS_ONE_NORMS:
        return name, kind, dense(value).float() - 1.0
    k, v = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    grouped = _ungroup_order(k, v // k, dv)  # over v * dv channels
    heads = _ungroup_order(k, v // k, 1)  # over v heads
    if part == "attn_qkv":
        value = _rows(value, torch.cat([torch.arange(2 * k * dk), 2 * k * dk + grouped]))
    elif part == "attn_gate":
        value = _rows(value, grouped)
    elif part in ("ssm_beta", "ssm_alpha"):
        value = _rows(value, heads)
    elif part == "ssm_a":
        value = torch.log(-dense(value).float()[heads])
    elif part == "ssm_dt":
        name, kind, value = name[: -len(".dt")] + ".dt_bias", "", dense(value)[heads]
    elif part == "ssm_conv1d":
        conv = dense(value)  # [channels, kernel]
        value = conv[torch.cat([torch.arange(2 * k * dk), 2 * k * dk + grouped])].unsqueeze(1)
    elif part == "ssm_out":
        value = _columns(value, grouped, dv)
    return name, kind, value


def _ungroup_order(k: int, per_key: int, dim: int) -> torch.Tensor:
    """Indices that take tiled rows ([per_key, k, dim]) back to grouped ones ([k, per_key, dim])."""
    return torch.arange(k * per_key * dim).view(per_key, k, dim).transpose(0, 1).reshape(-1)


def _rows(value: torch.Tensor | PackedWeight, order: torch.Tensor) -> torch.Tensor | PackedWeight:
    if len(order) == value.shape[0] and torch.equal(order, torch.arange(len(order))):
        return value
    return value.rows(order) if isinstance(value, PackedWeight) else value[order]


def _columns(value: torch.Tensor | PackedWeight, order: torch.Tensor, dim: int) -> torch.Tensor | PackedWeight:
    """Columns reordered; a quantized weight moves whole blocks of 32 where heads span whole blocks."""
    if torch.equal(order, torch.arange(len(order))):
        return value
    if isinstance(value, PackedWeight):
        if dim % value.group:
            return dense(value)[:, order]
        blocks = order.view(-1, value.group)[:, 0] // value.group
        n = value.values.shape[0]
        vals = value.values.view(n, len(blocks), -1)[:, blocks].reshape(n, -1)
        return PackedWeight(value.method, vals.contiguous(), value.scales[:, blocks].contiguous(), value.group)
    return value[:, order]


def _unpermute_rotary(value: torch.Tensor | PackedWeight, heads: int) -> torch.Tensor | PackedWeight:
    """llama.cpp's converter orders each Llama head's q/k rows as pairs (i, i + d/2) interleaved;
    Hugging Face's rotate-half order has the two halves apart. Rows only: quantized rows move whole."""
    n = value.shape[0]
    return _rows(value, torch.arange(n).view(heads, n // heads // 2, 2).transpose(1, 2).reshape(-1))
