"""What every decoder model file shares: the token embedding, the final norm and the lm_head,
and the mapping of checkpoint tensors onto Anna's (fused) modules.

A model file (llama.py, qwen3_5.py) subclasses ``CausalLM``, builds ``self.rotary`` and
``self.layers`` (each called as layer(rope, hidden, residual, its cache, meta)) and writes
``cache_specs``; the forward loop, loading, the CPU kernels' weight layouts and logits are here.
Names: a checkpoint holds ``q_proj``, ``k_proj`` and ``v_proj`` where Anna runs one ``qkv_proj``
matmul; ``STACKED_PARAMS`` says which checkpoint tensor is which shard of which fused module.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Callable, Iterable

import torch
from torch import nn

from anna.model.config import ModelConfig
from anna.model.layers import RMSNorm
from anna.model.linear import Linear, QuantLinear, check_shape, make_linear
from anna.model.ops import TORCH_OPS, ModelOps
from anna.model.quantization import dense
from anna.model.registry import ARCHITECTURES

if TYPE_CHECKING:
    from anna.model.attention import AttentionMetadata
    from anna.parallel.sharding import VocabShard

Loader = Callable[[torch.Tensor, str, str], None]  # (checkpoint tensor, its name, its file)

# Checkpoint name fragment -> (fused module name, shard index)
STACKED_PARAMS = {
    ".q_proj.": (".qkv_proj.", 0),
    ".k_proj.": (".qkv_proj.", 1),
    ".v_proj.": (".qkv_proj.", 2),
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
}


class CausalLM(nn.Module):
    stacked_params: dict[str, tuple[str, int]] = STACKED_PARAMS
    final_norm: type[RMSNorm] = RMSNorm

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, ops: ModelOps = TORCH_OPS,
                 activation_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.family = ARCHITECTURES[cfg.architecture].family
        self.activation_dtype = activation_dtype or dtype
        self.norm = self.final_norm(cfg.hidden_size, cfg.rms_norm_eps, dtype, ops)
        self.lm_head = make_linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype, ops=ops,
                                   method=ops.quant.lm_head_method)
        self.lm_head.profile_name = "lm_head"
        if cfg.tie_word_embeddings and isinstance(self.lm_head, QuantLinear):
            # The quantized lm_head is the only copy: lookups dequantize the rows they need.
            self.register_parameter("embed_tokens", None)
        else:
            self.embed_tokens = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype),
                                             requires_grad=False)
            if cfg.tie_word_embeddings:
                self.lm_head.weight = self.embed_tokens
        self.skipped_tensors: dict[str, int] = {}  # checkpoint prefix -> tensors seen there and not loaded
        # tensor parallelism (parallel/sharding.py): this rank's slice of the vocabulary, or None
        self.vocab_shard: VocabShard | None = None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """A fresh tensor (the residual stream may be updated in place)."""
        if self.vocab_shard is not None:
            return self.vocab_shard.embed(self._embedding_rows, input_ids)
        return self._embedding_rows(input_ids)

    def _embedding_rows(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens is None:
            return self.lm_head.dequantized(input_ids).to(self.activation_dtype)
        if self.config.tie_word_embeddings:  # the lm_head's weight, in the lm_head's layout
            return self.lm_head.weight_rows(input_ids).to(self.activation_dtype)
        return self.embed_tokens[input_ids].to(self.activation_dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, layer_caches: list,
                meta: "AttentionMetadata") -> torch.Tensor:
        """Hidden states of the batch's new tokens; ``layer_caches``: each layer's, as its cache
        spec says ((K, V) paged tensors or a dict of state tensors)."""
        hidden = self.embed(input_ids)
        rope = self.rotary.batch(positions, hidden.dtype)
        residual = None
        for layer, cache in zip(self.layers, layer_caches):
            hidden, residual = layer(rope, hidden, residual, cache, meta)
        return self.norm(hidden, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        return logits if self.vocab_shard is None else self.vocab_shard.gather_logits(logits)

    # ---- weights ----
    TOP_LEVEL_PARTS = ("lm_head", "mtp")  # modules named as they are, outside the family's checkpoint prefix
    # Checkpoint prefixes that hold no text-model weights -> why they are not loaded (logged once).
    SKIPPED_PREFIXES: dict[str, str] = {}

    def checkpoint_targets(self) -> dict[str, Loader]:
        """Every checkpoint tensor this model needs -> a function(tensor, name, where) that loads it."""
        targets: dict[str, Loader] = {}
        for mod_name, module in self.named_modules():
            # the checkpoint's top-level parts (lm_head, a multi-token-prediction head) keep their names
            prefix = "" if mod_name.split(".")[0] in self.TOP_LEVEL_PARTS else self.family.checkpoint_prefix
            if isinstance(module, (Linear, QuantLinear)):
                full = prefix + mod_name
                for kind in ("weight", "bias"):
                    if kind == "bias" and module.bias is None:
                        continue
                    if len(module.shard_sizes) == 1:
                        names = [(f"{full}.{kind}", 0)]
                    else:
                        names = [(f"{full}.{kind}".replace(fused, fragment), shard)
                                 for fragment, (fused, shard) in self.stacked_params.items() if fused in full + "."]
                    for ckpt, shard in names:
                        targets[self._checkpoint_name(ckpt)] = partial(_load_linear, module, kind, shard)
            elif isinstance(module, RMSNorm):
                targets[f"{prefix}{mod_name}.weight"] = partial(_copy_into, module.weight, module.weight_offset)
            if hasattr(module, "own_checkpoint_targets"):  # parameters that are not linear layers or norms
                for local, loader in module.own_checkpoint_targets().items():
                    targets[f"{prefix}{mod_name}.{local}"] = loader
        prefix = self.family.checkpoint_prefix
        if self.embed_tokens is not None:
            targets[f"{prefix}embed_tokens.weight"] = partial(_copy_into, self.embed_tokens, 0.0) \
                if self.vocab_shard is None else partial(_copy_rows, self.vocab_shard, self.embed_tokens)
        if self.config.tie_word_embeddings:
            loader = targets.pop("lm_head.weight")
            if self.embed_tokens is None:  # quantized: the embedding checkpoint tensor feeds the lm_head
                targets[f"{prefix}embed_tokens.weight"] = loader
        return targets

    def _checkpoint_name(self, name: str) -> str:
        """A tensor's name in the checkpoints of this family (e.g. Mixtral's block_sparse_moe.experts.N.w1)."""
        for ours, theirs in self.family.checkpoint_names:
            name = name.replace(ours, theirs)
        return name

    def interleave_for_cpu_kernels(self, converted: bool = False) -> None:
        """After loading: store the weights Anna's CPU kernel serves in the layout it reads
        (``converted``: they already are, read back from the int4 layout cache)."""
        for module in self.modules():
            if isinstance(module, (Linear, QuantLinear)):
                module.interleave_for_cpu_kernel(converted)

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]], where: str) -> set[str]:
        """Load checkpoint tensors (converting or quantizing them); return the names consumed."""
        targets = self.checkpoint_targets()
        loaded = set()
        for name, tensor in tensors:
            target = targets.get(name)
            if target is None:  # e.g. rotary inv_freq buffers, a tied lm_head, a vision tower
                skipped = next((p for p in self.SKIPPED_PREFIXES if name.startswith(p)), None)
                if skipped is not None:
                    self.skipped_tensors[skipped] = self.skipped_tensors.get(skipped, 0) + 1
                continue
            target(tensor, name, where)
            loaded.add(name)
        return loaded

    def skipped_parts(self) -> list[str]:
        """One line per checkpoint part that was present and not loaded, saying why."""
        return [f"{count} tensors under {prefix}* not loaded: {self.SKIPPED_PREFIXES[prefix]}"
                for prefix, count in self.skipped_tensors.items()]


def _load_linear(module: Linear | QuantLinear, kind: str, shard: int, tensor: torch.Tensor, name: str,
                 where: str) -> None:
    if module.tensor_parallel is not None:  # this rank's rows or columns (parallel/sharding.py)
        row_scales = isinstance(module, QuantLinear) and module.kind == 0 and not module.group
        tensor = module.tensor_parallel.take(kind, shard, tensor, row_scales)
    module.load(kind, shard, tensor, name, where)


def _copy_rows(vocab: "VocabShard", param: torch.Tensor, tensor: torch.Tensor, name: str, where: str) -> None:
    """An embedding's rows of this rank's vocabulary slice (tensor parallelism)."""
    check_shape(name, where, (vocab.vocab, param.shape[1]), tuple(tensor.shape))
    _copy_into(param, 0.0, vocab.take_rows(tensor), name, where)


def _copy_into(param: torch.Tensor, offset: float, tensor: torch.Tensor, name: str, where: str) -> None:
    """param = tensor (+ offset, in fp32: a zero-centred norm's weight is stored as 1 + w)."""
    check_shape(name, where, tuple(param.shape), tuple(tensor.shape))
    tensor = dense(tensor)
    param.data.copy_(tensor.float() + offset if offset else tensor)
