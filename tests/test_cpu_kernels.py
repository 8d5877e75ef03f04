"""Anna's float matmul kernel and its interleaved weight layout, against torch, at every M the
routing can send it (1 to cpu_gemv_max_rows) and with rows that do not fill a block."""

import pytest
import torch
import torch.nn.functional as F

from anna.model.kv_format import KVFormat
from anna.model.linear import Linear, gather_interleaved_rows, interleave_rows
from anna.model.ops import LinearRouting
from anna.platforms.cpu.isa import detect_isa
from anna.platforms.cpu.kernels import LEVEL_CFLAGS
from anna.platforms.cpu.ops import CpuKernelOps
from conftest import kernels_at_level


@pytest.fixture(scope="module", params=list(LEVEL_CFLAGS))
def kernels(request, cache_dir):
    """The kernels built for each level this CPU has (the others are skipped, with the reason)."""
    return kernels_at_level(request.param, cache_dir)


@pytest.mark.parametrize("n", [64, 67])  # 67: three rows past the last full block of 4
def test_pack_rows_round_trip_and_row_lookup(kernels, n):
    w = torch.randn(n, 40).to(torch.bfloat16)
    packed = interleave_rows(w)
    assert not torch.equal(packed[:4], w[:4])  # the layout really changes
    assert torch.equal(kernels.deinterleave(packed), w.float())
    assert torch.equal(gather_interleaved_rows(packed, torch.arange(n)), w)
    ids = torch.tensor([[0, 5, n - 1], [n - 2, 3, 63]])
    assert torch.equal(gather_interleaved_rows(packed, ids), w[ids])


# bf16 weights on the avx2 level: converted block by block, or widened in registers from M = 4 on
# (cpu_bf16_pair_max_rows); other levels and types ignore the bound
WIDENED = 1 << 30


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n, k", [(96, 64), (35, 136)])  # K = 136: not a multiple of 16 (the AVX2 loop at every level)
@pytest.mark.parametrize("pair_max_rows", [0, WIDENED], ids=["converted", "widened"])
def test_gemv_matches_torch_at_every_m(kernels, dtype, n, k, pair_max_rows):
    torch.manual_seed(0)
    w = torch.randn(n, k).to(dtype)
    bias = torch.randn(n)
    packed = interleave_rows(w)
    for m in range(1, 131):
        x = torch.randn(m, k)
        got = kernels.gemv(x, packed, bias, bf16_pair_max_rows=pair_max_rows)
        want = F.linear(x, w.float(), bias)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=f"M={m}")


def bf16_dot(kernels):
    """Skip unless the kernels can run bf16 dot products here: an AVX-512 build on a CPU with AVX512-BF16."""
    here = detect_isa()
    if kernels.level == "avx2" or not here.has("avx512_bf16"):
        pytest.skip(f"bf16 dot products: kernel level {kernels.level} on {here.model_name} (instruction sets up to "
                    f"{here.available}) has no vdpbf16ps path")


@pytest.mark.parametrize("n, k", [(96, 64), (35, 136), (4 * 11 + 2, 24)])  # 11 blocks: 4 + 4 + 3 singles, 2 tail rows
def test_gemv_on_bf16_dot_products_is_x_rounded_to_bf16_at_every_m(kernels, n, k):
    """With bf16_dot_rows, bf16 weights multiply x rounded to bf16 (vdpbf16ps): torch's product of
    the rounded x, summed in fp32, at every M up to 130 and in every part of the matmul (groups of
    4 blocks, single blocks, the row-major tail rows); below the threshold x stays fp32."""
    bf16_dot(kernels)
    torch.manual_seed(0)
    w = torch.randn(n, k).to(torch.bfloat16)
    bias = torch.randn(n)
    packed = interleave_rows(w)
    for m in range(1, 131):
        x = torch.randn(m, k)
        rounded = F.linear(x.bfloat16().float(), w.float(), bias)
        torch.testing.assert_close(kernels.gemv(x, packed, bias, bf16_dot_rows=1), rounded, rtol=1e-5, atol=1e-5,
                                   msg=f"M={m}")
        got = kernels.gemv(x, packed, bias, bf16_dot_rows=m + 1)  # x has fewer rows than the threshold
        torch.testing.assert_close(got, F.linear(x, w.float(), bias), rtol=1e-4, atol=1e-4, msg=f"M={m}")
        if m > 3:
            assert not torch.equal(got, rounded)


def test_gemv_rows_do_not_depend_on_the_thread_count(kernels):
    """Threads share the blocks of rows in chunks and take each other's leftovers (work_split.h):
    every row exactly once, also with more threads than blocks and with tail rows."""
    threads = torch.get_num_threads()
    for n in [35, 4099]:
        packed = interleave_rows(torch.randn(n, 64).to(torch.bfloat16))
        bias = torch.randn(n)
        for m in [1, 7]:  # 7: more than one group of x rows per block of weights
            x = torch.randn(m, 64)
            try:
                torch.set_num_threads(1)
                want = kernels.gemv(x, packed, bias)
                for t in [2, 3, 16]:
                    torch.set_num_threads(t)
                    assert torch.equal(kernels.gemv(x, packed, bias), want), (n, m, t)
            finally:
                torch.set_num_threads(threads)


def test_gemv_of_a_wide_weight_matches_torch_whatever_the_thread_count(kernels):
    """A weight whose threads' shares span many blocks (K = 896 as in a 0.5B model's layers): each
    thread runs its share in chunks of blocks, every group of x rows through a whole chunk
    (cpu_kernels.c: run_blocks_pairs), so some rows are reached late in a chunk, some in a later
    chunk. Every row as torch gives it, and the same bits with 1 thread as with 2 or 3."""
    threads = torch.get_num_threads()
    torch.manual_seed(0)
    n, k = 4099, 896
    for dtype in (torch.bfloat16, torch.float16):
        w = torch.randn(n, k).to(dtype)
        bias = torch.randn(n)
        packed = interleave_rows(w)
        for m, pair_max_rows in [(1, WIDENED), (5, WIDENED), (16, WIDENED), (67, WIDENED), (16, 0), (67, 0)]:
            x = torch.randn(m, k)
            try:
                torch.set_num_threads(1)
                want = kernels.gemv(x, packed, bias, bf16_pair_max_rows=pair_max_rows)
                torch.testing.assert_close(want, F.linear(x, w.float(), bias), rtol=1e-4, atol=1e-3,
                                           msg=f"{dtype} M={m}")
                for t in [2, 3]:
                    torch.set_num_threads(t)
                    assert torch.equal(kernels.gemv(x, packed, bias, bf16_pair_max_rows=pair_max_rows), want), \
                        (dtype, m, t, pair_max_rows)
            finally:
                torch.set_num_threads(threads)


def test_bf16_weights_are_widened_in_registers_from_4_rows_up_to_the_bound(kernels):
    """On the avx2 level a bf16 gemv of M rows widens the weights in registers when 4 <= M <=
    bf16_pair_max_rows and converts them block by block otherwise: the two paths add in different
    orders, so each M gives exactly one path's bits. Also per group of anna_gemv_experts."""
    from anna.platforms.cpu.kernels import WEIGHT_TYPES

    if not kernels.widens_bf16_pairs:
        pytest.skip(f"kernel level {kernels.level} converts bf16 weights (or multiplies them on vdpbf16ps)")
    torch.manual_seed(3)
    packed = interleave_rows(torch.randn(64, 256).to(torch.bfloat16))
    for m in (3, 4, 8, 9):
        x = torch.randn(m, 256)
        widened = kernels.gemv(x, packed, None, bf16_pair_max_rows=WIDENED)
        converted = kernels.gemv(x, packed, None, bf16_pair_max_rows=0)
        assert m < 4 or not torch.equal(widened, converted), m  # else this test could not tell them apart
        assert torch.equal(kernels.gemv(x, packed, None, bf16_pair_max_rows=8), widened if 4 <= m <= 8 else converted)
    experts = [packed, interleave_rows(torch.randn(64, 256).to(torch.bfloat16))]
    table = torch.tensor([w.data_ptr() for w in experts], dtype=torch.int64)
    starts = torch.tensor([0, 9, 14], dtype=torch.int64)  # 9 rows: converted; 5 rows: widened
    x = torch.randn(14, 256)
    out = kernels.gemv_experts(x, table, torch.tensor([1, 0]), starts, WEIGHT_TYPES[torch.bfloat16], 64,
                               bf16_pair_max_rows=8)
    assert torch.equal(out[:9], kernels.gemv(x[:9], experts[1], None, bf16_pair_max_rows=0))
    assert torch.equal(out[9:], kernels.gemv(x[9:], experts[0], None, bf16_pair_max_rows=WIDENED))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_expert_gemv_equals_one_call_per_expert(kernels, dtype):
    """anna_gemv_experts (several experts' matmuls in one call, as a mixture-of-experts layer runs
    them) gives exactly what one gemv per expert gives: 67 rows (a tail of 3), groups of 1 to 7
    rows (7: more than one group of x rows per block of weights), an unused expert, experts out of order."""
    from anna.platforms.cpu.kernels import WEIGHT_TYPES

    torch.manual_seed(2)
    experts = [interleave_rows(torch.randn(67, 64).to(dtype)) for _ in range(4)]
    table = torch.tensor([w.data_ptr() for w in experts], dtype=torch.int64)
    ids, starts = [3, 0, 2], torch.tensor([0, 7, 8, 12], dtype=torch.int64)  # expert 1 unused
    x = torch.randn(12, 64)
    out = kernels.gemv_experts(x, table, torch.tensor(ids), starts, WEIGHT_TYPES[dtype], 67)
    expected = torch.cat([kernels.gemv(x[starts[g]:starts[g + 1]], experts[e], None) for g, e in enumerate(ids)])
    assert torch.equal(out, expected)
    if dtype == torch.bfloat16 and kernels.level != "avx2" and detect_isa().has("avx512_bf16"):
        # bf16 dot products from 4 rows: groups of 7 and 4 rows take them, the group of 1 does not
        out = kernels.gemv_experts(x, table, torch.tensor(ids), starts, WEIGHT_TYPES[dtype], 67, bf16_dot_rows=4)
        expected = torch.cat([kernels.gemv(x[starts[g]:starts[g + 1]], experts[e], None, bf16_dot_rows=4)
                              for g, e in enumerate(ids)])
        assert torch.equal(out, expected)
        assert torch.equal(out[7], kernels.gemv(x[7:8], experts[0], None)[0])


def test_linear_packs_once_and_serves_every_route(kernels):
    """An interleaved Linear gives torch's result through the kernel (small M) and through the fp32
    GEMM on the unpacked weight (M above cpu_gemv_max_rows)."""
    torch.manual_seed(1)
    lin = Linear(64, [48, 20], bias=True, dtype=torch.bfloat16,
                 ops=CpuKernelOps(kernels, routing=LinearRouting(gemv_max_rows=8)))
    w = torch.randn(68, 64).to(torch.bfloat16)
    lin.weight.data.copy_(w)
    lin.bias.data.normal_()
    lin.interleave_for_cpu_kernel()
    lin.interleave_for_cpu_kernel()  # idempotent
    assert lin.interleaved and not torch.equal(lin.weight, w)
    for m in (1, 8, 9, 40):
        x = torch.randn(m, 64)
        want = F.linear(x, w.float(), lin.bias.float())
        torch.testing.assert_close(lin(x), want, rtol=1e-4, atol=1e-4, msg=f"M={m}")
    ids = torch.tensor([0, 7, 67])
    assert torch.equal(lin.weight_rows(ids), w[ids])


@pytest.mark.parametrize("rows, width", [(1, 4864), (3, 300), (40, 520)])  # tails of 8 and of 256
def test_silu_mul_matches_torch(kernels, rows, width):
    gate_up = torch.randn(rows, 2 * width) * 6  # exp's whole useful range, and past it
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -88.0])
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(kernels.silu_mul(gate_up), F.silu(gate) * up, rtol=2e-6, atol=1e-6)
    # bf16 rows: the fp32 result of the same bf16 inputs, rounded once to bf16 (nearest even)
    half = gate_up.to(torch.bfloat16)
    got = kernels.silu_mul(half)
    gate, up = half.float().chunk(2, dim=-1)
    want = (gate / (1 + torch.exp(-gate)) * up).to(torch.bfloat16)
    assert got.dtype == torch.bfloat16
    assert ((got.float() - want.float()).abs() <= 2 ** -7 * want.float().abs() + 1e-30).all()
    assert (got == want).float().mean() > 0.99  # (exp's approximation may land across a rounding edge)


@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows, dim", [(1, 896), (37, 1003), (5, 13)])  # tails past the last 8
@pytest.mark.parametrize("with_delta", [False, True])
def test_add_rmsnorm_matches_torch(kernels, rows, dim, wdtype, with_delta):
    """x += delta in place (when given), then rmsnorm(x) * w: against fp64."""
    x = torch.randn(rows, dim) * 3
    x[0] *= 1e-3  # a small row: eps matters
    delta = torch.randn(rows, dim) if with_delta else None
    w = (torch.randn(dim) / 2 + 1).to(wdtype)
    x0 = x.clone()
    got = kernels.add_rmsnorm(x, delta, w, 1e-6)
    s = x0.double() + (delta.double() if with_delta else 0)
    want = w.double() * s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(x, s.float(), rtol=0, atol=0)  # the residual stream, updated in place
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-7)


# a real vocabulary; tails past the last 32 and the last 8 values; one group of 32 and a tail; one group of 8
@pytest.mark.parametrize("width", [151936, 1003, 37, 12])
def test_argmax_matches_torch_ties_nan_and_inf(kernels, width):
    logits = torch.randn(7, width)
    logits[1, [5, width - 2]] = 50.0  # a tie: the first index wins
    logits[2, width - 1] = 60.0  # the maximum in the tail
    logits[3] = float("-inf")  # nothing allowed: index 0
    logits[4, [9, width - 3]] = float("nan")  # the first NaN, as torch
    logits[5, :] = 1.0  # all equal
    logits[6, width - 5] = float("inf")
    expected = logits.argmax(dim=-1)
    assert kernels.argmax(logits).tolist() == expected.tolist()
    assert kernels.argmax(logits.bfloat16()).tolist() == logits.bfloat16().argmax(dim=-1).tolist()


# (contexts, threads): many sequences, a job per (sequence, KV head); contexts longer than an even
# share of the step's positions among the threads, cut into parts merged after: one sequence on 4
# threads (2 parts of 3,000 positions), on 16 (8 parts of 2,600, the last two past its end), a long
# context (8 parts) beside one too short to cut, and on 4 threads a long request beside a short one
# (4 jobs for 4 threads, but uneven: 2 parts of 3,000)
DECODE_ATTENTION_CASES = {"many_sequences": ([1, 7, 8, 9, 40, 100, 300, 600], None),
                          "parts_on_4_threads": ([3000], 4),
                          "parts_on_16_threads": ([2600], 16),
                          "parts_beside_one_pass": ([1, 5000], 16),
                          "long_beside_short": ([3000, 40], 4)}


@pytest.mark.parametrize("case", list(DECODE_ATTENTION_CASES))
@pytest.mark.parametrize("window", [0, 24, 1500])
def test_paged_decode_attention_matches_torch(kernels, window, case):
    """Grouped-query decode attention through scattered block tables; contexts around the 8-position
    chunks the kernel scores together, past the 256-position tiles it takes the softmax in (each
    tile's maximum against the running one), and long enough to be cut into parts among threads."""
    torch.manual_seed(2)
    contexts, threads = DECODE_ATTENTION_CASES[case]
    heads, kv_heads, dim, block_size = 14, 2, 64, 16
    blocks = sum(-(-c // block_size) for c in contexts) + 8
    k_cache = torch.randn(blocks, kv_heads, block_size, dim)
    v_cache = torch.randn(blocks, kv_heads, block_size, dim)
    order = torch.randperm(blocks)
    width = max(-(-c // block_size) for c in contexts)
    tables = torch.zeros(len(contexts), width, dtype=torch.long)
    used = 0
    for i, c in enumerate(contexts):
        n = -(-c // block_size)
        tables[i, :n] = order[used:used + n]
        used += n
    q = torch.randn(len(contexts), heads, dim)
    scale = dim ** -0.5
    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        got = kernels.decode_attention(q, k_cache, v_cache, KVFormat("float32", dim), tables, torch.tensor(contexts),
                                       window or None, scale)
    finally:
        torch.set_num_threads(before)
    for i, c in enumerate(contexts):
        slots = [(int(tables[i, p // block_size]), p % block_size) for p in range(c)]
        if window:
            slots = slots[-window:]
        k = torch.stack([k_cache[b, :, o] for b, o in slots])  # [len, kv_heads, dim]
        v = torch.stack([v_cache[b, :, o] for b, o in slots])
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
        weights = torch.softmax(torch.einsum("hd,lhd->hl", q[i], k) * scale, dim=-1)
        torch.testing.assert_close(got[i], torch.einsum("hl,lhd->hd", weights, v), rtol=1e-4, atol=1e-5)


def _causal_mask(tq: int, tk: int, window: int | None = None) -> torch.Tensor:
    """[Tq, Tk], True where query i (position tk - tq + i) sees the key: at or before it, and
    within its last ``window`` keys."""
    qpos, kpos = torch.arange(tk - tq, tk).unsqueeze(1), torch.arange(tk).unsqueeze(0)
    return (kpos <= qpos) & (kpos > qpos - window) if window else kpos <= qpos


def _exact_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            window: int | None = None) -> torch.Tensor:
    """float64 attention of q [Tq, H, D], the last Tq of the Tk positions of k, v [Tk, KV, D]."""
    tq, heads, dim = q.shape
    tk, kv_heads, _ = k.shape
    qd, kd, vd = (t.double().transpose(0, 1) for t in (q, k, v))
    kd, vd = (t.repeat_interleave(heads // kv_heads, dim=0) for t in (kd, vd))
    scores = (qd @ kd.transpose(1, 2)) * dim ** -0.5
    scores.masked_fill_(~_causal_mask(tq, tk, window), float("-inf"))
    return (torch.softmax(scores, dim=-1) @ vd).transpose(0, 1)


def _torch_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            window: int | None = None) -> torch.Tensor:
    """torch's SDPA in the inputs' dtype, with _exact_causal_attention's shapes and mask."""
    mask = _causal_mask(q.shape[0], k.shape[0], window)
    return F.scaled_dot_product_attention(*(t.transpose(0, 1)[None] for t in (q, k, v)), attn_mask=mask,
                                          enable_gqa=True)[0].transpose(0, 1)


def _prefill_attention_cases(lengths: list[int]) -> list[tuple[int, int, int | None]]:
    """(Tq, Tk, window): prompts of ``lengths`` over themselves; chunks after a cached prefix (the
    last Tq of Tk positions); sliding windows that cut the context (a row's first key inside a key
    block, or whole blocks before it skipped), over a prompt itself and after a prefix."""
    cases = [(t, t, None) for t in lengths]
    cases += [(tq, tk, None) for tk in (9, 64, 65, 200) for tq in (1, 7, 8, 9, 64) if tq < tk]
    cases += [(t, t, w) for t in (9, 70, 130, 300) for w in (1, 5, 8, 64, 100) if w < t]
    cases += [(tq, tk, w) for tk, tq in ((65, 1), (200, 9), (200, 64), (300, 130)) for w in (3, 64, 70)]
    return cases


@pytest.mark.parametrize("heads, kv_heads, dim", [(14, 2, 64), (4, 4, 128), (6, 3, 72), (2, 1, 8)])
def test_causal_prefill_attention_matches_torch_at_every_length(kernels, heads, kv_heads, dim):
    """A prompt's causal attention over itself against an exact softmax in float64, no further
    from it than torch's fp32 SDPA (twice its largest error + 2e-5, at most): every length 1..130 (work
    items of 8 positions, key blocks of 64, a last block cut at the diagonal) and 300; grouped and
    plain heads; head sizes that are whole 64-column passes, a 64 + 8 one and a single vector.
    Large scores (x 4) make the running maximum move between key blocks. Then chunks after a
    cached prefix (the last Tq of Tk positions), the same way; then sliding windows that cut the
    context (a row's first key inside a key block, or whole blocks before it skipped), over a
    prompt itself and after a prefix."""
    g = torch.Generator().manual_seed(4)
    for tokens, context, window in _prefill_attention_cases([*range(1, 131), 300]):
        q = torch.randn(tokens, heads, dim, generator=g) * 4
        k, v = (torch.randn(context, kv_heads, dim, generator=g) * 4 for _ in range(2))
        got = kernels.causal_attention(q, k, v, dim ** -0.5, window)
        sdpa = _torch_causal_attention(q, k, v, window)
        want = _exact_causal_attention(q, k, v, window)
        error, torch_error = ((t.double() - want).abs().max().item() for t in (got, sdpa))
        assert error <= 2 * torch_error + 2e-5, (tokens, context, window, error, torch_error)


def _check_bf16_attention(kernels, lengths: list[int], heads: int, kv_heads: int, dim: int, seed: int) -> None:
    """bf16=True against an exact float64 softmax of q, k, v rounded to bf16, no further from it
    than torch's SDPA run in bf16 on them (its largest error + 1e-3), over _prefill_attention_cases
    of ``lengths``. The kernel only rounds its inputs and the probabilities, so it stays nearer the
    exact result than the fp32 kernel on the unrounded inputs is. Scores x 4 move the running
    maximum between key blocks and leave keys whose weight underflows."""
    g = torch.Generator().manual_seed(seed)
    for tokens, context, window in _prefill_attention_cases(lengths):
        q = torch.randn(tokens, heads, dim, generator=g) * 4
        k, v = (torch.randn(context, kv_heads, dim, generator=g) * 4 for _ in range(2))
        qb, kb, vb = (t.bfloat16() for t in (q, k, v))
        got = kernels.causal_attention(q, k, v, dim ** -0.5, window, bf16=True)
        sdpa = _torch_causal_attention(qb, kb, vb, window)
        want = _exact_causal_attention(qb.float(), kb.float(), vb.float(), window)
        fp32 = kernels.causal_attention(q, k, v, dim ** -0.5, window)
        assert got.isfinite().all(), (tokens, context, window)
        error, torch_error, fp32_error = ((t.double() - want).abs().max().item() for t in (got, sdpa, fp32))
        assert error <= torch_error + 1e-3, (tokens, context, window, error, torch_error)
        if tokens > 1:  # (one query sees one key: every path returns its value row)
            assert error < fp32_error, (tokens, context, window, error, fp32_error)


@pytest.mark.parametrize("heads, kv_heads, dim", [(14, 2, 64), (4, 4, 128), (6, 3, 80), (2, 1, 16), (2, 2, 256)])
def test_bf16_prefill_attention_is_exact_attention_of_the_rounded_inputs(kernels, heads, kv_heads, dim):
    """bf16=True (vdpbf16ps; at the amx level AMX tiles for the head sizes they take) as
    _check_bf16_attention says: the lengths, cached prefixes and sliding windows of the fp32 test
    above, on head sizes that are whole 64-column passes, 64 + 16, a single vector and the largest
    the bf16 kernel takes."""
    bf16_dot(kernels)
    _check_bf16_attention(kernels, [*range(1, 131, 3), 130, 300], heads, kv_heads, dim, seed=5)


@pytest.mark.parametrize("build", ["native", "emulated"])
@pytest.mark.parametrize("heads, kv_heads, dim", [(14, 2, 64), (4, 4, 128), (6, 3, 96), (2, 1, 32), (2, 2, 256)])
def test_amx_tile_prompt_attention_is_exact_attention_of_the_rounded_inputs(cache_dir, build, heads, kv_heads,
                                                                              dim):
    """The amx level's bf16 prompt attention on AMX tiles (native on an AMX CPU; the same code with
    the tile instructions emulated in C on any AVX-512 VNNI CPU) as _check_bf16_attention says: the
    lengths, cached prefixes and sliding windows of the tests above (work items of 16 positions,
    key blocks of 64), head sizes from one 32-wide step to the largest the tiles take, in whole and
    half 64-dimension passes."""
    from conftest import amx_kernels

    kernels = amx_kernels(build, cache_dir)
    assert kernels.tile_attention(dim)
    lengths = [*range(1, 131, 7), 130, 300] if build == "native" else [1, 16, 17, 63, 64, 65, 130]
    _check_bf16_attention(kernels, lengths, heads, kv_heads, dim, seed=7)


def _tile_matmul_cases(build: str) -> list[tuple[int, int, int]]:
    """(M, N, K): M from one row to several 32-row steps with a short last one; N and K from one
    tile to several; threads sharing the rows (a small weight, many rows) or the weight's panels;
    fp32 outputs over 4 MB (written past the caches: M = 1,100, N = 1,024; M = 300, N = 4,096); on
    the native build also a block of x rows over the 1 MB the kernel keeps per thread (M = 600 at
    K = 896) and more panels than one packed group holds (N = 4,736 at K = 896)."""
    cases = [(m, 64, 64) for m in (1, 2, 15, 16, 17, 31, 32, 33, 63, 100, 130)] + [(40, 96, 160), (70, 32, 32),
                                                                                  (1100, 1024, 64), (300, 4096, 64)]
    if build == "native":
        cases += [(600, 96, 896), (40, 4736, 896), (257, 1152, 896), (130, 896, 4864)]
    else:
        cases += [(600, 64, 896)]
    return cases


@pytest.mark.parametrize("build", ["native", "emulated"])
def test_amx_tile_matmul_is_the_exact_matmul_of_the_rounded_inputs(cache_dir, build):
    """The amx level's large-M bf16 matmul on tiles, reading the interleaved weight as stored
    (native on an AMX CPU; the same code with the tile instructions emulated in C on any AVX-512
    VNNI CPU): x (fp32, rounded by the kernel, or bf16) times W^T plus the bias equals the float64
    product of the bf16 values within fp32 summation error, in fp32 and rounded once to bf16."""
    from conftest import amx_kernels

    kernels = amx_kernels(build, cache_dir)
    g = torch.Generator().manual_seed(11)
    for m, n, k in _tile_matmul_cases(build):
        w = (torch.randn(n, k, generator=g) / k ** 0.5).to(torch.bfloat16)
        bias = torch.randn(n, generator=g).to(torch.bfloat16)
        x = torch.randn(m, k, generator=g)
        assert kernels.tile_matmul_fits(interleave_rows(w))
        exact = F.linear(x.to(torch.bfloat16).double(), w.double(), bias.double())
        scale = F.linear(x.to(torch.bfloat16).double().abs(), w.double().abs()).max().item()
        for xin, b in ((x, bias), (x.to(torch.bfloat16), None)):
            want = exact if b is not None else exact - bias.double()
            got = kernels.tile_matmul(xin, interleave_rows(w), b)
            assert got.dtype == torch.float32 and got.shape == (m, n)
            assert (got.double() - want).abs().max().item() <= 1e-5 * scale, (m, n, k)
            half = kernels.tile_matmul(xin, interleave_rows(w), b, out_dtype=torch.bfloat16)
            assert half.dtype == torch.bfloat16
            torch.testing.assert_close(half.float(), got.to(torch.bfloat16).float(), rtol=2 ** -8, atol=1e-6 * scale)


@pytest.mark.parametrize("build", ["native", "emulated"])
def test_amx_tile_gated_activation_is_silu_gate_times_up(cache_dir, build):
    """The gated MLP's first matmul with its activation in the same kernel: [gate | up] = x W^T + b
    from the interleaved [2I, K] weight, silu(gate) * up rounded once to bf16, against float64."""
    from conftest import amx_kernels

    kernels = amx_kernels(build, cache_dir)
    g = torch.Generator().manual_seed(12)
    for m, n, k in _tile_matmul_cases(build):
        w = (torch.randn(n, k, generator=g) / k ** 0.5).to(torch.bfloat16)
        bias = torch.randn(n, generator=g) / 4
        x = torch.randn(m, k, generator=g)
        for b in (bias, None):
            h = F.linear(x.to(torch.bfloat16).double(), w.double(), None if b is None else b.double())
            gate, up = h.chunk(2, dim=-1)
            want = F.silu(gate) * up
            got = kernels.tile_gated_act(x, interleave_rows(w), b)
            assert got.dtype == torch.bfloat16 and got.shape == (m, n // 2)
            torch.testing.assert_close(got.double(), want, rtol=2 ** -8, atol=1e-5, msg=lambda e: f"{(m, n, k)}: {e}")


# (M, N, K) for the avx2 level's register-blocked GEMM: M from one row to several blocks of x
# rows (192 KB: 48 rows at K = 896) with a short last microkernel (M % 6); N with a last panel of
# fewer than 8 or than 16 rows, and a row-major tail past the last block of 4 (N = 45, 67); panels split
# between the threads, or (few panels) the rows; more panels than one packed group (2 MB: 36 at
# K = 896); K in chunks (over 2,048 columns: 4,104 as 3 x 1,368).
PANEL_CASES = [(1, 16, 8), (5, 20, 16), (6, 32, 64), (7, 45, 136), (13, 28, 64), (100, 67, 200), (130, 96, 896),
               (257, 1152, 896), (33, 2400, 896), (300, 16, 64), (40, 48, 4104)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_panel_matmul_is_the_fp32_matmul_of_the_stored_weights(cache_dir, dtype):
    """The avx2 level's large-M matmul (csrc/panel_matmul.c), reading the interleaved weight as
    stored: x W^T plus the bias equals the float64 product of the same values within fp32
    summation error, at every shape of PANEL_CASES."""
    from conftest import kernels_at_level

    kernels = kernels_at_level("avx2", cache_dir)
    g = torch.Generator().manual_seed(21)
    for m, n, k in PANEL_CASES:
        w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype)
        bias = torch.randn(n, generator=g)
        x = torch.randn(m, k, generator=g)
        packed = interleave_rows(w)
        assert kernels.panel_matmul_fits(packed)
        exact = F.linear(x.double(), w.double())
        scale = F.linear(x.double().abs(), w.double().abs()).max().item()
        for b in (bias, None):
            got = kernels.panel_matmul(x, packed, b)
            want = exact if b is None else exact + b.double()
            assert got.dtype == torch.float32 and got.shape == (m, n)
            assert (got.double() - want).abs().max().item() <= 1e-5 * scale, (m, n, k)


def test_panel_gated_activation_is_silu_gate_times_up(cache_dir):
    """The gated MLP's first matmul on the avx2 level's GEMM with its activation in the same kernel:
    [gate | up] = x W^T + b from the interleaved [2I, K] weight, silu(gate) * up against float64;
    I = 12 leaves the last panel half empty; a K past one chunk, or halves that split a block of 4
    rows, do not fit."""
    from conftest import kernels_at_level

    kernels = kernels_at_level("avx2", cache_dir)
    g = torch.Generator().manual_seed(22)
    for m, n, k in [(1, 16, 8), (7, 24, 64), (33, 96, 896), (130, 64, 2048), (257, 9728 // 8, 896)]:
        w = (torch.randn(n, k, generator=g) / k ** 0.5).to(torch.bfloat16)
        bias = torch.randn(n, generator=g) / 4
        x = torch.randn(m, k, generator=g)
        assert kernels.panel_matmul_fits(interleave_rows(w), gated=True)
        for b in (bias, None):
            h = F.linear(x.double(), w.double(), None if b is None else b.double())
            gate, up = h.chunk(2, dim=-1)
            got = kernels.panel_gated_act(x, interleave_rows(w), b)
            assert got.dtype == torch.float32 and got.shape == (m, n // 2)
            torch.testing.assert_close(got.double(), F.silu(gate) * up, rtol=1e-5, atol=1e-5,
                                       msg=lambda e: f"{(m, n, k)}: {e}")
    for n, k in ((64, 2056), (20, 64)):
        assert not kernels.panel_matmul_fits(torch.zeros(n, k, dtype=torch.bfloat16), gated=True), (n, k)


def test_bf16_prefill_attention_runs_fp32_where_it_cannot_run_bf16(kernels):
    """The avx2 build, and a head size that is not a multiple of 16 or is over 256, run the fp32
    kernel for bf16=True."""
    if kernels.level != "avx2":
        bf16_dot(kernels)  # (an AVX-512 build asked for bf16 on a CPU without it would fault)
    g = torch.Generator().manual_seed(6)
    for dim in (64, 72, 256, 272):
        q, k, v = (torch.randn(40, 2, dim, generator=g) for _ in range(3))
        fp32 = kernels.causal_attention(q, k, v, dim ** -0.5)
        same = kernels.level == "avx2" or dim % 16 or dim > 256
        assert torch.equal(kernels.causal_attention(q, k, v, dim ** -0.5, bf16=True), fp32) == bool(same), dim


@pytest.mark.parametrize("norm_dtype", [torch.float32, torch.bfloat16])
def test_gated_delta_decode_steps_match_torch(kernels, norm_dtype):
    """The C conv step and gated-delta decode against torch's, on the states in place: three
    sequences in scattered slots, two key heads each serving two value heads, decays strong
    enough to leave denormal-sized state entries (which the kernel flushes)."""
    from anna.model.config import LinearAttentionConfig
    from anna.model.gated_delta import GatedDeltaNet, conv_step, decode_after_conv

    lin = LinearAttentionConfig(("linear_attention",), num_key_heads=2, num_value_heads=4, key_head_dim=32,
                                value_head_dim=16, conv_kernel=4)
    layer = GatedDeltaNet(64, lin, 1e-6, norm_dtype, torch.float32)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        layer.A_log.copy_(torch.rand(4, generator=g) * 4)
        layer.dt_bias.copy_(torch.randn(4, generator=g))
        layer.norm.weight.copy_(1 + 0.1 * torch.randn(16, generator=g))
        layer.conv_weight.copy_(torch.randn(4, lin.conv_dim, generator=g))
    slots = torch.tensor([5, 0, 2])
    conv_state = torch.randn(6, 3, lin.conv_dim, generator=g)
    state = torch.randn(6, 4, 32, 16, generator=g) * 0.1
    state[0, 1] *= 1e-37  # a head whose memory has decayed to the denormal range
    mixed = torch.randn(3, lin.conv_dim, generator=g)
    z, ba = torch.randn(3, 64, generator=g), torch.randn(3, 8, generator=g) * 3
    ref_conv, ref_state = conv_state.clone(), state.clone()
    conved_ref = conv_step(mixed, ref_conv, slots, layer.conv_weight)
    conved = kernels.conv_step(mixed, conv_state, slots, layer.conv_weight)
    torch.testing.assert_close(conved, conved_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(conv_state, ref_conv)
    ref = decode_after_conv(layer, conved_ref, z, ba, ref_state, slots)
    out = kernels.gated_delta_decode(conved, z, ba, state, slots, layer.A_log, layer.dt_bias, layer.norm.weight,
                                     layer.norm.eps, lin.num_key_heads)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(state, ref_state, rtol=1e-4, atol=1e-6)
    untouched = [1, 3, 4]
    assert torch.equal(state[untouched], ref_state[untouched])
