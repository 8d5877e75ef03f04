"""Gated DeltaNet, the linear-attention layer of Qwen3.5 and Qwen3-Next, and the torch versions
of its two recurrences.

Per sequence the layer keeps a fixed-size state instead of a KV that grows (cache_spec.StateSpec):
the last ``kernel - 1`` inputs of its depthwise causal conv ("conv", [kernel - 1, channels], time
first so that one time step is a contiguous row) and the delta-rule memory ("recurrent", [value
heads, key dim, value dim], fp32). The runner keeps them as [slots, ...] tensors and hands each
step the batch's slots (``AttentionMetadata.state_slots``, decodes first, then one per prefill
chunk); a sequence's slot is zeroed before its first token (runtime/model_runner.py).

The gated delta rule, per value head, with S the [key dim, value dim] memory::

    S = exp(g) * S                     # g = -exp(A_log) * softplus(a + dt_bias) <= 0: decay
    S = S + k (beta * (v - S^T k))^T   # beta = sigmoid(b): how much of the error to write
    o = S^T q                          # q, k L2-normalised, q scaled by key_dim ** -0.5

Decode runs it token by token (``ops.gated_delta_step``); prefill in chunks of 64 tokens
(``chunked_gated_delta``), where the delta updates within a chunk are solved as one unit lower
triangular system, so a chunk costs a few matmuls instead of 64 sequential steps.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from anna.model.attention import AttentionMetadata
from anna.model.cache_spec import StateSpec, StateTensor
from anna.model.config import LinearAttentionConfig
from anna.model.layers import RMSNorm
from anna.model.linear import Linear, check_shape, make_linear
from anna.model.ops import TORCH_OPS, ModelOps

GATED_DELTA_CHUNK = 64
L2_EPS = 1e-6


def state_spec(lin: LinearAttentionConfig, conv_dtype: torch.dtype) -> StateSpec:
    return StateSpec((StateTensor("conv", (lin.conv_kernel - 1, lin.conv_dim), conv_dtype),
                      StateTensor("recurrent", (lin.num_value_heads, lin.key_head_dim, lin.value_head_dim),
                                  torch.float32)))


# ---- the recurrences in torch (what every platform runs unless its ops have a kernel) ----
def conv_step(x: torch.Tensor, conv_state: torch.Tensor, slots: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """One token per sequence: x [B, C]; conv_state [slots, K - 1, C] (updated); weight [K, C].
    Returns silu(conv) [B, C]."""
    window = torch.cat([conv_state[slots], x.unsqueeze(1).to(conv_state.dtype)], dim=1)  # [B, K, C]
    conv_state[slots] = window[:, 1:]
    return F.silu((window * weight).sum(dim=1)).to(x.dtype)


def in_row_order(step, states: list[torch.Tensor], slots: torch.Tensor, src_slots: torch.Tensor) -> torch.Tensor:
    """Run a one-token-per-row ``step(rows, slots)`` row by row, each row's state first copied from
    its source slot, so that a row sees what the row before it wrote (the torch version of the
    kernels' src_slots)."""
    outs = []
    for r in range(slots.shape[0]):
        dst, src = slots[r:r + 1], src_slots[r:r + 1]
        if int(src) != int(dst):
            for tensor in states:
                tensor[dst] = tensor[src]
        outs.append(step(slice(r, r + 1), dst))
    return torch.cat(outs)


def conv_prefill(x: torch.Tensor, conv_state: torch.Tensor, slot: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A chunk of one sequence: x [L, C] after the inputs its conv state holds. Returns silu(conv)
    [L, C] and leaves the chunk's last K - 1 inputs in the state."""
    kernel, length = weight.shape[0], x.shape[0]
    window = torch.cat([conv_state[slot], x.to(conv_state.dtype)])  # [K - 1 + L, C]
    out = window[:length] * weight[0]
    for j in range(1, kernel):
        out += window[j:j + length] * weight[j]
    if kernel > 1:
        conv_state[slot] = window[-(kernel - 1):]
    return F.silu(out).to(x.dtype)


def gated_delta_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """One token per sequence (fp32): q, k [B, H, Dk]; v [B, H, Dv]; g, beta [B, H]; state [slots,
    H, Dk, Dv] (updated). Returns [B, H, Dv]."""
    s = state[slots] * _exp(g)[..., None, None]
    error = v - torch.einsum("bhkv,bhk->bhv", s, k)
    s = s + k.unsqueeze(-1) * (beta.unsqueeze(-1) * error).unsqueeze(-2)
    state[slots] = s
    return torch.einsum("bhkv,bhk->bhv", s, q)


def chunked_gated_delta(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                        initial: torch.Tensor, chunk: int = GATED_DELTA_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule over L tokens of one sequence (fp32): q, k [L, H, Dk]; v [L, H, Dv]; g, beta [L, H];
    initial [H, Dk, Dv]. Returns the outputs [L, H, Dv] and the final state.

    Within a chunk, with G the cumulative decay and D[i, j] = exp(G_i - G_j) for j <= i, the
    values each token writes (after the memory's own prediction is taken away) solve
    (I + strictly_lower(beta K K^T * D)) U = beta V - (beta K exp(G)) S, so U = U0 - W S with U0
    and W from one triangular solve per chunk; the chunks then run in sequence."""
    length, heads, dk = k.shape
    pad = -length % chunk
    n = (length + pad) // chunk

    def blocks(x: torch.Tensor) -> torch.Tensor:  # [L, H, ...] -> [H, n, chunk, ...], zero-padded
        x = x.transpose(0, 1)
        if pad:
            x = F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad))
        return x.reshape(heads, n, chunk, *x.shape[2:])

    q, k, v, g, beta = blocks(q), blocks(k), blocks(v), blocks(g), blocks(beta)
    cum = g.cumsum(-1)  # [H, n, c]
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = _exp((cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(~lower, float("-inf")))  # [H, n, c, c]
    k_beta = k * beta.unsqueeze(-1)
    system = (k_beta @ k.transpose(-1, -2)) * decay  # unit lower triangular: the diagonal is ignored
    u0 = torch.linalg.solve_triangular(system, v * beta.unsqueeze(-1), upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * _exp(cum).unsqueeze(-1), upper=False, unitriangular=True)
    inner = (q @ k.transpose(-1, -2)) * decay  # attention within the chunk, causal
    q_decayed = q * _exp(cum).unsqueeze(-1)  # reads the state as it was when the chunk began
    last = cum[..., -1:]
    k_decayed = k * _exp(last - cum).unsqueeze(-1)  # each token's write, decayed to the chunk's end
    chunk_decay = _exp(last).unsqueeze(-1)  # [H, n, 1, 1]
    out = torch.empty_like(u0)
    s = initial.to(torch.float32)
    for i in range(n):
        u = u0[:, i] - w[:, i] @ s
        out[:, i] = q_decayed[:, i] @ s + inner[:, i] @ u
        s = s * chunk_decay[:, i] + k_decayed[:, i].transpose(-1, -2) @ u
    return out.reshape(heads, n * chunk, -1)[:, :length].transpose(0, 1), s


def _exp(x: torch.Tensor) -> torch.Tensor:
    """exp, with exactly 0 below e^-60 (1e-26, far below what an fp32 sum can see): decays of a
    running sum underflow into denormals otherwise, on which x86 arithmetic is 10-100x slower,
    and the matmuls that read them with it."""
    return x.masked_fill(x < -30.0, float("-inf")).exp()


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


# ---- the layer ----
class GatedRMSNorm(RMSNorm):
    """norm(x) * w * silu(z), per value head (z: the layer's output gate)."""

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return (self.ops.add_rmsnorm(x, None, self.weight, self.eps) * F.silu(z.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """in_proj (q, k, v, z in one matmul; b, a in another) -> causal conv + SiLU over q, k, v -> the gated
    delta rule -> gated RMSNorm with z -> out_proj."""

    def __init__(self, hidden: int, lin: LinearAttentionConfig, eps: float, dtype: torch.dtype,
                 activation_dtype: torch.dtype, ops: ModelOps = TORCH_OPS) -> None:
        super().__init__()
        self.lin = lin
        heads = lin.num_value_heads
        self.split = [lin.conv_dim, lin.value_dim]
        self.in_proj = make_linear(hidden, self.split, bias=False, dtype=dtype, ops=ops)
        # b and a (a few rows that set every token's write strength and decay) stay unquantized, as
        # routers do: quantized, their error compounds through the recurrence
        self.in_proj_ba = Linear(hidden, [heads, heads], bias=False, dtype=dtype, ops=ops)
        # [kernel, channels]: one time step's weights contiguous, as the conv state's rows
        self.conv_weight = nn.Parameter(torch.empty(lin.conv_kernel, lin.conv_dim, dtype=activation_dtype),
                                        requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(heads, dtype=torch.float32), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(heads, dtype=torch.float32), requires_grad=False)
        self.norm = GatedRMSNorm(lin.value_head_dim, eps, dtype, ops)
        self.out_proj = make_linear(lin.value_dim, hidden, bias=False, dtype=dtype, ops=ops)
        self.ops = ops
        self.tensor_parallel = None  # parallel/sharding.py's GatedDeltaShard: this rank's channels and heads

    def own_checkpoint_targets(self) -> dict:
        shard = self.tensor_parallel
        if shard is None:
            return {"conv1d.weight": partial(_load_conv_weight, self.conv_weight),
                    "A_log": partial(_load_vector, self.A_log), "dt_bias": partial(_load_vector, self.dt_bias)}
        from anna.parallel.sharding import take_rows

        def rows(load, ranges, param, tensor, name, where):
            load(param, take_rows(tensor, ranges), name, where)

        return {"conv1d.weight": partial(rows, _load_conv_weight, shard.channels, self.conv_weight),
                "A_log": partial(rows, _load_vector, shard.heads, self.A_log),
                "dt_bias": partial(rows, _load_vector, shard.heads, self.dt_bias)}

    def forward(self, x: torch.Tensor, state: dict[str, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        ops, t = self.ops, x.shape[0]
        mixed, z = self.in_proj(x).split(self.split, dim=-1)
        ba = self.in_proj_ba(x)
        slots, nd = meta.state_slots, meta.num_decode_tokens
        src = meta.state_src_slots
        out = x.new_empty(t, self.lin.value_dim)
        if nd:  # one token each: the platform's decode steps, on the states in place
            with ops.region("conv"):
                conved = ops.conv_step(mixed[:nd], state["conv"], slots[:nd], self.conv_weight, src)
            with ops.region("gated_delta"):
                out[:nd] = ops.gated_delta_decode(self, conved, z[:nd], ba[:nd], state["recurrent"], slots[:nd], src)
        for j, chunk in enumerate(meta.prefills):
            sl = slice(chunk.query_start, chunk.query_start + chunk.query_len)
            out[sl] = self._prefill(mixed[sl], z[sl], ba[sl], state, slots[nd + j])
        return self.out_proj(out)

    def _prefill(self, mixed: torch.Tensor, z: torch.Tensor, ba: torch.Tensor, state: dict[str, torch.Tensor],
                 slot: torch.Tensor) -> torch.Tensor:
        """A chunk of one sequence, from the state its slot holds (left at the chunk's end)."""
        with self.ops.region("conv"):
            conved = conv_prefill(mixed, state["conv"], slot, self.conv_weight)
        with self.ops.region("gated_delta"):
            q, k, v, g, beta = self.gates(conved, ba)
            out, state["recurrent"][slot] = chunked_gated_delta(q, k, v, g, beta, state["recurrent"][slot])
            return self.norm(out.to(mixed.dtype), z.reshape(*out.shape[:2], -1)).reshape(out.shape[0], -1)

    def gates(self, conved: torch.Tensor, ba: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """From the conv's output and b/a (fp32): q (L2-normalised, scaled by key_dim ** -0.5) and
        k, each key head repeated over its value heads, v, the log decay g and beta."""
        lin, t = self.lin, conved.shape[0]
        heads = lin.num_value_heads
        q, k, v = conved.float().split([lin.key_dim, lin.key_dim, lin.value_dim], dim=-1)
        repeat = heads // lin.num_key_heads  # each key head serves `repeat` consecutive value heads
        q = (l2_normalize(q.view(t, lin.num_key_heads, -1)) * lin.key_head_dim ** -0.5).repeat_interleave(repeat, 1)
        k = l2_normalize(k.view(t, lin.num_key_heads, -1)).repeat_interleave(repeat, 1)
        b, a = ba.float().chunk(2, dim=-1)
        g = -self.A_log.exp() * F.softplus(a + self.dt_bias)
        return q, k, v.view(t, heads, -1), g, torch.sigmoid(b)


def decode_after_conv(layer: GatedDeltaNet, conved: torch.Tensor, z: torch.Tensor, ba: torch.Tensor,
                      state: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """torch's version of ``ops.gated_delta_decode``: gates, one delta step per row, gated norm."""
    q, k, v, g, beta = layer.gates(conved, ba)
    out = gated_delta_step(q, k, v, g, beta, state, slots)
    return layer.norm(out.to(conved.dtype), z.reshape(*out.shape[:2], -1)).reshape(out.shape[0], -1)


def _load_conv_weight(param: torch.Tensor, tensor: torch.Tensor, name: str, where: str) -> None:
    """The checkpoint's [channels, 1, kernel] (nn.Conv1d) as [kernel, channels]."""
    check_shape(name, where, (param.shape[1], 1, param.shape[0]), tuple(tensor.shape))
    param.data.copy_(tensor[:, 0].t())


def _load_vector(param: torch.Tensor, tensor: torch.Tensor, name: str, where: str) -> None:
    check_shape(name, where, tuple(param.shape), tuple(tensor.shape))
    param.data.copy_(tensor)
