"""Write a random-weight model with a real model's shapes (speed does not depend on weight values).

    python benchmarks/make_random_model.py --shape qwen2.5-0.5b --out benchmarks/models/qwen2.5-0.5b

--layers N keeps the first N layers of a shape: a mixture of experts such as Qwen3-30B-A3B does
not fit this machine whole, but its per-layer cost (and so speed per layer) is the real one.

The tokenizer is the demo model's (about 800 tokens) unless --tokenizer-vocab N asks for a
byte-level BPE of N tokens trained on the Python standard library's sources, for benchmarks whose
cost depends on the vocabulary (constrained decoding's token masks).
"""

from __future__ import annotations

import argparse
import json
import sysconfig
from pathlib import Path

import torch
from safetensors.torch import save_file

from anna.weights.demo_model import write_demo_tokenizer

SHAPES = {
    "qwen2.5-0.5b": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=896,
                         intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         vocab_size=151936, max_position_embeddings=32768, rope_theta=1000000.0,
                         rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False),
    "qwen3-0.6b": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=1024,
                       intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, vocab_size=151936, max_position_embeddings=40960, rope_theta=1000000.0,
                       rms_norm_eps=1e-6, tie_word_embeddings=True),
    "llama-3.2-1b": dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=2048,
                         intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                         head_dim=64, vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
                         rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                         rms_norm_eps=1e-5, tie_word_embeddings=True),
    "qwen3-30b-a3b": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=2048,
                          intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                          head_dim=128, vocab_size=151936, max_position_embeddings=40960, rope_theta=1000000.0,
                          rms_norm_eps=1e-6, tie_word_embeddings=False, num_experts=128, num_experts_per_tok=8,
                          moe_intermediate_size=768, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[]),
    # hybrid: 3 Gated DeltaNet layers, then one gated full-attention layer (head_dim 256, rotary on 64)
    "qwen3.5-0.8b": dict(architectures=["Qwen3_5ForCausalLM"], model_type="qwen3_5_text", hidden_size=1024,
                         intermediate_size=3584, num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=2,
                         head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
                         linear_value_head_dim=128, linear_conv_kernel_dim=4, full_attention_interval=4,
                         vocab_size=248320, max_position_embeddings=262144,
                         rope_parameters={"rope_theta": 10000000.0, "partial_rotary_factor": 0.25, "rope_type": "default"},
                         rms_norm_eps=1e-6, tie_word_embeddings=True),
    "qwen3.5-35b-a3b": dict(architectures=["Qwen3_5MoeForCausalLM"], model_type="qwen3_5_moe_text", hidden_size=2048,
                            intermediate_size=512, num_hidden_layers=40, num_attention_heads=16, num_key_value_heads=2,
                            head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                            linear_value_head_dim=128, linear_conv_kernel_dim=4, full_attention_interval=4,
                            vocab_size=248320, max_position_embeddings=262144,
                            rope_parameters={"rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                                             "rope_type": "default"},
                            rms_norm_eps=1e-6, tie_word_embeddings=False, num_experts=256, num_experts_per_tok=8,
                            moe_intermediate_size=512, shared_expert_intermediate_size=512),
}
HYBRID_TYPES = ("qwen3_5_text", "qwen3_5_moe_text")


def hybrid_layer_shapes(cfg: dict, i: int) -> dict[str, tuple[int, ...]]:
    """The mixer of layer i of a Qwen3.5 model: Gated DeltaNet, or (every fourth) gated attention."""
    h, p = cfg["hidden_size"], f"model.layers.{i}."
    if (i + 1) % cfg["full_attention_interval"] == 0:
        hd = cfg["head_dim"]
        q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
        return {p + "self_attn.q_proj.weight": (2 * q, h), p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)}
    key = cfg["linear_num_key_heads"] * cfg["linear_key_head_dim"]
    value, heads = cfg["linear_num_value_heads"] * cfg["linear_value_head_dim"], cfg["linear_num_value_heads"]
    a = p + "linear_attn."
    return {a + "in_proj_qkv.weight": (2 * key + value, h), a + "in_proj_z.weight": (value, h),
            a + "in_proj_b.weight": (heads, h), a + "in_proj_a.weight": (heads, h),
            a + "conv1d.weight": (2 * key + value, 1, cfg["linear_conv_kernel_dim"]), a + "A_log": (heads,),
            a + "dt_bias": (heads,), a + "norm.weight": (cfg["linear_value_head_dim"],), a + "out_proj.weight": (h, value)}


def tensor_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    qwen2 = cfg["model_type"] == "qwen2"
    experts, moe_inter = cfg.get("num_experts", 0), cfg.get("moe_intermediate_size", 0)
    shapes = {"model.embed_tokens.weight": (cfg["vocab_size"], h), "model.norm.weight": (h,)}
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (cfg["vocab_size"], h)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)})
        if cfg["model_type"] in HYBRID_TYPES:
            shapes.update(hybrid_layer_shapes(cfg, i))
        else:
            shapes.update({p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                           p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q)})
        mlps = [(p + f"mlp.experts.{e}.", moe_inter) for e in range(experts)] or [(p + "mlp.", inter)]
        for m, size in mlps:
            shapes.update({m + "gate_proj.weight": (size, h), m + "up_proj.weight": (size, h),
                           m + "down_proj.weight": (h, size)})
        if experts:
            shapes[p + "mlp.gate.weight"] = (experts, h)
        if cfg.get("shared_expert_intermediate_size"):
            shared = cfg["shared_expert_intermediate_size"]
            shapes.update({p + "mlp.shared_expert.gate_proj.weight": (shared, h),
                           p + "mlp.shared_expert.up_proj.weight": (shared, h),
                           p + "mlp.shared_expert.down_proj.weight": (h, shared),
                           p + "mlp.shared_expert_gate.weight": (1, h)})
        if qwen2:
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)})
        if cfg["model_type"] in ("qwen3", "qwen3_moe"):
            shapes.update({p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)})
    return shapes


def write_large_tokenizer(target: Path, vocab_size: int) -> tuple[int, int, int]:
    """A real-size byte-level BPE vocabulary with the demo model's special tokens and chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from anna.weights.demo_model import CHATML, SPECIAL_TOKENS

    files = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator((f.read_text(encoding="utf-8", errors="ignore") for f in files), trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(target / "tokenizer.json"))
    (target / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": CHATML, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None}))
    return tok.get_vocab_size(), tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-0.5b")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tokenizer-vocab", type=int, default=0, help="Train a BPE tokenizer of this many tokens.")
    ap.add_argument("--layers", type=int, default=0, help="Keep only this many layers of the shape.")
    args = ap.parse_args()
    cfg = dict(SHAPES[args.shape], torch_dtype=args.dtype, hidden_act="silu")
    if args.layers:
        cfg["num_hidden_layers"] = min(args.layers, cfg["num_hidden_layers"])
    args.out.mkdir(parents=True, exist_ok=True)
    if args.tokenizer_vocab:
        vocab, eos, endoftext = write_large_tokenizer(args.out, args.tokenizer_vocab)
    else:
        vocab, eos, endoftext = write_demo_tokenizer(args.out)
    print(f"tokenizer: {vocab} tokens")
    cfg.update(eos_token_id=eos, bos_token_id=endoftext)
    (args.out / "config.json").write_text(json.dumps(cfg, indent=2))
    (args.out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(args.seed)
    tensors = {}
    zero_centred = cfg["model_type"] in HYBRID_TYPES  # norms hold w of norm(x) * (1 + w)
    for name, shape in tensor_shapes(cfg).items():
        if name.endswith("linear_attn.norm.weight"):
            tensors[name] = torch.ones(shape, dtype=dtype)
        elif name.endswith("norm.weight"):
            tensors[name] = (torch.zeros if zero_centred else torch.ones)(shape, dtype=dtype)
        elif name.endswith(("A_log", "dt_bias")):  # decays as in a trained model: A in [1, 16]
            tensors[name] = (torch.rand(shape, generator=gen) * 2.77).to(dtype) if name.endswith("A_log") \
                else torch.ones(shape, dtype=dtype)
        else:
            tensors[name] = (torch.randn(shape, generator=gen) * 0.02).to(dtype)
    save_file(tensors, str(args.out / "model.safetensors"))
    total = sum(t.numel() for t in tensors.values())
    print(f"wrote {args.out}: {args.shape}, {cfg['num_hidden_layers']} layers, {total / 1e6:.0f}M parameters, "
          f"{args.dtype}")


if __name__ == "__main__":
    main()
