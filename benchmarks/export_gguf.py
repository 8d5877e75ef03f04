"""Write a Llama, Qwen2, Qwen3 or Qwen3-MoE model as a GGUF file, so that llama.cpp can be
measured on the same shapes and the same machine as Anna (llama-bench, llama-server), and so that
Anna's GGUF loading can be tested on files written by the gguf package's own writer.

    python benchmarks/export_gguf.py --model benchmarks/models/qwen2.5-0.5b --out /tmp/qwen2.5-0.5b-f16.gguf

Only what llama.cpp needs to run the model is written: the architecture's hyperparameters, the
byte-level BPE vocabulary (padded to the embedding's rows), the chat template and the tensors under
llama.cpp's names (a Llama's q/k rows permuted as llama.cpp's converter does). Matrices are F16, or
with --outtype q8_0 / q4_0 quantized by the gguf package (every matrix, the embedding included, as
`llama-quantize --pure` does); llama.cpp's own `llama-quantize` makes the usual mixed files from the
F16 one.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import gguf
import numpy as np
from safetensors.torch import load_file

LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
}
EXPERT_NAMES = {"gate_proj": "ffn_gate_exps.weight", "up_proj": "ffn_up_exps.weight",
                "down_proj": "ffn_down_exps.weight"}  # one [experts, rows, cols] tensor each
ARCHS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3moe",
         "qwen3_5_text": "qwen35", "qwen3_5_moe_text": "qwen35moe"}
HYBRID_NAMES = {  # Qwen3.5's own tensors, under llama.cpp's names
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "linear_attn.in_proj_qkv.weight": "attn_qkv.weight", "linear_attn.in_proj_z.weight": "attn_gate.weight",
    "linear_attn.in_proj_b.weight": "ssm_beta.weight", "linear_attn.in_proj_a.weight": "ssm_alpha.weight",
    "linear_attn.A_log": "ssm_a", "linear_attn.dt_bias": "ssm_dt.bias", "linear_attn.conv1d.weight": "ssm_conv1d.weight",
    "linear_attn.norm.weight": "ssm_norm.weight", "linear_attn.out_proj.weight": "ssm_out.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight", "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight", "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
}
HYBRID_ARCHS = ("qwen35", "qwen35moe")
KEPT_F32 = ("ssm_conv1d.weight", "ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")  # as llama.cpp's converter keeps them
OUTTYPES = {"f16": None, "q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0}
FILE_TYPES = {"f16": gguf.LlamaFileType.MOSTLY_F16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
              "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}
TOP_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}


def gguf_name(name: str, arch: str) -> str:
    if name in TOP_NAMES:
        return TOP_NAMES[name]
    _, _, index, rest = name.split(".", 3)  # model.layers.{i}.{rest}
    hybrid = HYBRID_NAMES.get(rest) if arch in HYBRID_ARCHS else None
    return f"blk.{index}.{hybrid or LAYER_NAMES[rest]}"


def hybrid_metadata(writer: gguf.GGUFWriter, cfg: dict) -> None:
    """Qwen3.5's Gated DeltaNet shapes and layer types, as llama.cpp's converter writes them."""
    writer.add_ssm_conv_kernel(cfg["linear_conv_kernel_dim"])
    writer.add_ssm_state_size(cfg["linear_key_head_dim"])
    writer.add_ssm_group_count(cfg["linear_num_key_heads"])
    writer.add_ssm_time_step_rank(cfg["linear_num_value_heads"])
    writer.add_ssm_inner_size(cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"])
    writer.add_array(f"{writer.arch}.attention.recurrent_layers", [t == "linear_attention" for t in cfg["layer_types"]])
    writer.add_full_attention_interval(cfg.get("full_attention_interval", 4))
    rope = cfg.get("rope_parameters") or {}
    writer.add_rope_dimension_count(int(cfg["head_dim"] * rope.get("partial_rotary_factor", 0.25)))
    writer.add_rope_dimension_sections(rope.get("mrope_section", [11, 11, 10]) + [0])


def to_hybrid_layout(name: str, w: np.ndarray, cfg: dict) -> np.ndarray:
    """What llama.cpp's converter does to a Qwen3.5 tensor: zero-centred norms (not Gated
    DeltaNet's) stored as 1 + w, A_log as -exp(A_log), the conv kernel squeezed, and where value
    heads outnumber key heads, value heads tiled ([v0: k0 k1, ...]) instead of grouped by key head."""
    if name.endswith("norm.weight") and "linear_attn." not in name:
        return w + 1.0
    if "linear_attn." not in name:
        return w
    k, v = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]

    def tiled(x: np.ndarray, dim: int, axis: int = 0) -> np.ndarray:
        x = np.moveaxis(x, axis, 0)
        x = x.reshape(k, v // k, dim, *x.shape[1:]).swapaxes(0, 1).reshape(x.shape)
        return np.moveaxis(x, 0, axis)

    qk = 2 * k * dk
    if name.endswith("A_log"):
        w = -np.exp(w)
    if name.endswith("conv1d.weight"):
        w = w.reshape(w.shape[0], w.shape[-1])
    if v == k:
        return w
    if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
        return np.concatenate([w[:qk], tiled(w[qk:], dv)])
    if name.endswith("in_proj_z.weight"):
        return tiled(w, dv)
    if name.endswith(("in_proj_b.weight", "in_proj_a.weight", "A_log", "dt_bias")):
        return tiled(w, 1)
    if name.endswith("out_proj.weight"):
        return tiled(w, dv, axis=1)
    return w


def add_vocabulary(writer: gguf.GGUFWriter, model_dir: Path, vocab_size: int, gen: dict) -> None:
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = dict(tok["model"]["vocab"])
    special = {t["content"]: t["id"] for t in tok.get("added_tokens", [])}
    vocab.update(special)
    by_id = {i: t for t, i in vocab.items()}
    tokens, types = [], []
    for i in range(vocab_size):
        if i in by_id:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.CONTROL if by_id[i] in special else gguf.TokenType.NORMAL)
        else:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"].get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    # GPT-2's split (a plain ByteLevel pre-tokenizer, as the demo tokenizer has) or Qwen2's
    pre = tok.get("pre_tokenizer") or {}
    writer.add_tokenizer_pre("gpt-2" if pre.get("type") == "ByteLevel" and pre.get("use_regex", True) else "qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    eos = gen.get("eos_token_id", 0)
    writer.add_eos_token_id(eos[0] if isinstance(eos, list) else eos)
    writer.add_bos_token_id(gen.get("bos_token_id", 0))
    writer.add_add_bos_token(False)
    tok_cfg = model_dir / "tokenizer_config.json"
    template = json.loads(tok_cfg.read_text()).get("chat_template") if tok_cfg.exists() else None
    if isinstance(template, str):
        writer.add_chat_template(template)


def permute_rotary(w: np.ndarray, heads: int) -> np.ndarray:
    """Hugging Face's rotate-half rows -> llama.cpp's interleaved pairs, per head (its converter's
    permute for Llama's q and k)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def matrix(array: np.ndarray, outtype: str) -> tuple[np.ndarray, gguf.GGMLQuantizationType]:
    qtype = OUTTYPES[outtype]
    if qtype is None or array.shape[-1] % 32:
        return array.astype(np.float16), gguf.GGMLQuantizationType.F16
    return gguf.quants.quantize(array.astype(np.float32), qtype), qtype


def export(model_dir: Path, out: Path, outtype: str = "f16", encode=None) -> None:
    """``encode(hf_name, array) -> (data, type) | None``: a caller's own encoding of some matrices
    (tests write K-quant blocks by hand: the gguf package has no K-quant quantizer)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    arch = ARCHS.get(cfg.get("model_type"))
    if arch is None:
        raise SystemExit(f"{model_dir}: model_type {cfg.get('model_type')!r} is not exported ({', '.join(ARCHS)} are)")
    gen_path = model_dir / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.exists() else {}
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_name(model_dir.name)
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    if cfg.get("head_dim"):
        writer.add_key_length(cfg["head_dim"])
        writer.add_value_length(cfg["head_dim"])
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")  # (transformers 5 writes the latter)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(cfg["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        if cfg.get("shared_expert_intermediate_size"):
            writer.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    if arch in HYBRID_ARCHS:
        hybrid_metadata(writer, cfg)
    rope = cfg.get("rope_parameters") or {}  # transformers 5 writes the theta there
    writer.add_rope_freq_base(cfg.get("rope_theta") or rope.get("rope_theta", 10000.0))
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_file_type(FILE_TYPES[outtype])
    add_vocabulary(writer, model_dir, cfg["vocab_size"], gen)
    by_layer: dict[tuple[str, str], dict[int, np.ndarray]] = {}  # (layer, projection) -> expert -> matrix
    for path in sorted(model_dir.glob("*.safetensors")):
        for name, tensor in load_file(path).items():
            array = tensor.float().numpy()  # llama.cpp keeps norms and biases in F32
            if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
                heads = cfg["num_attention_heads"] if "q_proj" in name else cfg["num_key_value_heads"]
                array = permute_rotary(array, heads)
            if arch in HYBRID_ARCHS:
                array = to_hybrid_layout(name, array, cfg)
            if ".mlp.experts." in name:  # model.layers.{i}.mlp.experts.{e}.{proj}.weight
                _, _, layer, _, _, expert, proj, _ = name.split(".")
                by_layer.setdefault((layer, proj), {})[int(expert)] = array
                continue
            if array.ndim == 1 or gguf_name(name, arch).endswith(KEPT_F32):
                writer.add_tensor(gguf_name(name, arch), array)
            else:
                data, qtype = (encode and encode(name, array)) or matrix(array, outtype)
                writer.add_tensor(gguf_name(name, arch), data, raw_dtype=qtype)
    for (layer, proj), by_expert in sorted(by_layer.items()):
        data, qtype = matrix(np.stack([by_expert[e] for e in sorted(by_expert)]), outtype)
        writer.add_tensor(f"blk.{layer}.{EXPERT_NAMES[proj]}", data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--outtype", default="f16", choices=sorted(OUTTYPES))
    args = parser.parse_args()
    export(args.model, args.out, args.outtype)
    print(f"wrote {args.out} ({args.out.stat().st_size / 2**20:.0f} MiB)")


if __name__ == "__main__":
    main()
