"""Write a Qwen2, Qwen3 or Qwen3-MoE benchmark model as an F16 GGUF file, so that llama.cpp can be
measured on the same shapes and the same machine as Anna (llama-bench, llama-server).

    pip install gguf
    python benchmarks/export_gguf.py --model benchmarks/models/qwen2.5-0.5b --out /tmp/qwen2.5-0.5b-f16.gguf

Only what llama.cpp needs to run the model is written: the architecture's hyperparameters, the
byte-level BPE vocabulary (padded to the embedding's rows) and the tensors under llama.cpp's names.
Quantized GGUF files (Q4_0, Q8_0) come from this one with llama.cpp's own `llama-quantize`.
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
ARCHS = {"qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3moe"}
TOP_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}


def gguf_name(name: str) -> str:
    if name in TOP_NAMES:
        return TOP_NAMES[name]
    _, _, index, rest = name.split(".", 3)  # model.layers.{i}.{rest}
    return f"blk.{index}.{LAYER_NAMES[rest]}"


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
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    eos = gen.get("eos_token_id", 0)
    writer.add_eos_token_id(eos[0] if isinstance(eos, list) else eos)
    writer.add_bos_token_id(gen.get("bos_token_id", 0))
    writer.add_add_bos_token(False)


def export(model_dir: Path, out: Path) -> None:
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
    if cfg.get("num_experts"):
        writer.add_expert_count(cfg["num_experts"])
        writer.add_expert_used_count(cfg["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    writer.add_rope_freq_base(cfg["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    add_vocabulary(writer, model_dir, cfg["vocab_size"], gen)
    experts: dict[tuple[str, str], dict[int, np.ndarray]] = {}  # (layer, projection) -> expert -> matrix
    for path in sorted(model_dir.glob("*.safetensors")):
        for name, tensor in load_file(path).items():
            array = tensor.float().numpy()  # llama.cpp keeps norms and biases in F32, matrices in F16
            if ".mlp.experts." in name:  # model.layers.{i}.mlp.experts.{e}.{proj}.weight
                _, _, layer, _, _, expert, proj, _ = name.split(".")
                experts.setdefault((layer, proj), {})[int(expert)] = array.astype(np.float16)
                continue
            writer.add_tensor(gguf_name(name), array if array.ndim == 1 else array.astype(np.float16))
    for (layer, proj), by_expert in sorted(experts.items()):
        writer.add_tensor(f"blk.{layer}.{EXPERT_NAMES[proj]}", np.stack([by_expert[e] for e in sorted(by_expert)]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    export(args.model, args.out)
    print(f"wrote {args.out} ({args.out.stat().st_size / 2**20:.0f} MiB)")


if __name__ == "__main__":
    main()
