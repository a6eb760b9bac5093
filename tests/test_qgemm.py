"""The block kernels (specdec.kernels.qgemm): right values, and row-invariant bits.

Values: the kernel's output equals, to fp32 rounding, the float64 product of the dequantized weights with
the activations as the kernel quantized them (so every block's integer arithmetic and scales are right).
Bits: row m's output does not depend on the number of rows, the other rows, the row's position, the
thread count, or the build (AMX tiles, AVX-512, AVX2, portable).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from specdec.kernels import native, qgemm, tuning
from specdec.models.dequant import dequantize_rows
from specdec.models.qlinear import QuantLinear

TYPES = sorted(qgemm.SUPPORTED_TYPES)  # Q4_0, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K
FP16_FIELDS = {2: [0], 6: [0], 8: [0], 12: [0, 2], 13: [0, 2], 14: [208]}  # byte offsets of fp16 scales


def runs_here(isa: str) -> bool:
    """Whether this machine runs the build: its CPU flags, and for AMX the OS's leave to use the tiles. A
    build that does not compile fails here, loudly (the engine would fall back to the next build)."""
    if not qgemm._ISA_CPU_FLAGS[isa] <= qgemm.cpu_flags():
        return False
    return isa != "avx512amx" or bool(qgemm.ops(isa).uses_tiles())


ISAS = [isa for isa in ("avx512amx", "avx512vnni", "avx2", "generic") if runs_here(isa)]


def random_blocks(qtype: int, rows: int, row_len: int, seed: int = 0) -> torch.Tensor:
    """Random bytes as GGUF blocks, with finite fp16 scales of a realistic size."""
    block_size, type_size = qgemm.BLOCK[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, row_len // block_size, type_size), dtype=np.uint8)
    for off in FP16_FIELDS[qtype]:
        scales = rng.uniform(1e-3, 2e-2, size=raw.shape[:2]).astype(np.float16)
        raw[..., off:off + 2] = scales.view(np.uint8).reshape(*raw.shape[:2], 2)
    return torch.from_numpy(raw.reshape(rows, -1))


def reference(x: torch.Tensor, w: torch.Tensor, qtype: int) -> torch.Tensor:
    """float64 product of the dequantized weights and the activations as the kernel quantizes them."""
    bs = qgemm.BLOCK[qtype][0] if qtype in (12, 13, 14) else 32
    q, _, d = qgemm.ops().quantize_acts(x.float(), bs)
    xq = (q.double().view(x.shape[0], -1, bs) * d.double()[..., None]).view(x.shape[0], -1)
    return xq @ dequantize_rows(w, qtype, x.shape[1]).double().T


@pytest.mark.parametrize("qtype", TYPES, ids=[qgemm.SUPPORTED_TYPES[t] for t in TYPES])
def test_values_equal_dequantized_product(qtype):
    K, N = 512, 40
    w = random_blocks(qtype, N, K)
    x = torch.randn(5, K)
    y = qgemm.qmm(x, [w], [qtype]).double()
    ref = reference(x, w, qtype)
    assert torch.allclose(y, ref, rtol=2e-5, atol=2e-5 * ref.abs().max().item())
    # and the activations' own quantization is within half a step of x
    q, sums, d = qgemm.ops().quantize_acts(x, 32)
    assert (q.float().view(5, -1, 32) * d[..., None] - x.view(5, -1, 32)).abs().le(d[..., None] / 2 + 1e-6).all()
    assert torch.equal(sums, q.view(5, -1, 16).sum(-1).to(torch.int16))


def test_quant_activations_on_the_kernels_agree_with_symmetric_rounding():
    x = torch.tensor([[0.0] * 31 + [2.0], [1.0, -1.0] * 16])
    q, _, d = qgemm.ops().quantize_acts(x, 32)
    assert torch.equal(d, torch.tensor([[2.0], [1.0]]) / 127)
    assert q[0, -1] == 127 and q[0, :-1].abs().sum() == 0 and q[1].tolist() == [127, -127] * 16


@pytest.mark.parametrize("qtype", TYPES, ids=[qgemm.SUPPORTED_TYPES[t] for t in TYPES])
def test_rows_are_invariant_to_batch_position_and_threads(qtype):
    K, N = 512, 72
    w = random_blocks(qtype, N, K, seed=1)
    x = torch.randn(64, K, dtype=torch.bfloat16)
    alone = torch.cat([qgemm.qmm(x[m:m + 1], [w], [qtype]) for m in range(64)])
    for M in (2, 3, 5, 8, 9, 16, 64):
        assert torch.equal(qgemm.qmm(x[:M], [w], [qtype]), alone[:M]), f"{M} rows"
    # the same row among other rows, at another position
    other = torch.randn(7, K, dtype=torch.bfloat16)
    mixed = torch.cat([other[:3], x[10:11], other[3:]])
    assert torch.equal(qgemm.qmm(mixed, [w], [qtype])[3], alone[10])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = qgemm.qmm(x, [w], [qtype])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one_thread, alone)


@pytest.mark.parametrize("qtype", TYPES, ids=[qgemm.SUPPORTED_TYPES[t] for t in TYPES])
def test_every_build_gives_the_same_bits(qtype):
    K, N = 768 if qtype in (12, 13, 14) else 800, 24  # 25 blocks of 32: groups of 8, a pair and an odd one
    w = random_blocks(qtype, N, K, seed=2)
    for M in (1, 2, 5, 11, 40):  # 1-2: channel pairs; 5, 11: rows side by side; 40: AMX tiles, where the CPU has them
        x = torch.randn(M, K)
        outs = [qgemm.qmm(x, [w], [qtype], isa=isa) for isa in ISAS]
        assert len(outs) >= 2  # at least the portable build and one vector build
        assert all(torch.equal(outs[0], o) for o in outs[1:]), (M, ISAS)


@pytest.mark.parametrize("qtype", TYPES, ids=[qgemm.SUPPORTED_TYPES[t] for t in TYPES])
def test_every_build_gives_the_same_bits_at_the_largest_integer_sums(qtype):
    """Every quant and scale at its largest (all bits set) times activations all at +127 or -127 (and
    alternating): the integer lanes the 512-bit kernels pack (sub-block sums in 16-bit halves) are at their
    bounds, and every build still gives the portable build's bits."""
    K, N = 2304 if qtype in (12, 13, 14) else 800, 9
    w = torch.full((N, K // qgemm.BLOCK[qtype][0], qgemm.BLOCK[qtype][1]), 0xFF, dtype=torch.uint8)
    for off in FP16_FIELDS[qtype]:
        w[..., off:off + 2] = torch.tensor([0.01], dtype=torch.float16).view(torch.uint8)
    if qtype == 14:
        w[..., 192:208] = torch.tensor([-128, 127] * 8, dtype=torch.int8).view(torch.uint8)  # signed scales
    w = w.reshape(N, -1)
    sign = torch.where(torch.arange(K) % 2 == 0, 1.0, -1.0)
    x = torch.stack([torch.ones(K), -torch.ones(K), sign, torch.ones(K)])
    for M in (1, 2, 4):
        outs = [qgemm.qmm(x[:M], [w], [qtype], isa=isa) for isa in ISAS]
        assert all(torch.equal(outs[-1], o) for o in outs), (M, ISAS)  # the last is the portable build
        assert outs[-1].abs().max() > 0


@pytest.mark.parametrize("qtype", TYPES, ids=[qgemm.SUPPORTED_TYPES[t] for t in TYPES])
def test_two_channel_and_one_channel_kernels_give_the_same_bits(qtype):
    """The 512-bit builds read two weight channels at a time for one or two rows where that was measured
    faster (`set_pair_rows`), else one (a row alone: 8 of its blocks side by side); every choice gives the
    portable build's bits."""
    wide = [isa for isa in ISAS if isa.startswith("avx512")]
    if not wide:
        pytest.skip("no AVX-512 build runs on this CPU")
    # an odd channel count (a last channel alone); k-quants: 9 blocks (one row takes them 8 side by side, then 1)
    K, N = 2304 if qtype in (12, 13, 14) else 800, 25
    w = random_blocks(qtype, N, K, seed=3)
    xs = {M: torch.randn(M, K) for M in (1, 2, 3)}
    want = {M: qgemm.qmm(x, [w], [qtype], isa="generic") for M, x in xs.items()}
    for isa in wide:
        lib, chosen = qgemm.ops(isa), qgemm.ops(isa).pair_rows()
        try:
            for mask in range(4):
                lib.set_pair_rows(mask)
                assert lib.pair_rows() == mask
                for M, x in xs.items():
                    assert torch.equal(qgemm.qmm(x, [w], [qtype], isa=isa), want[M]), (isa, mask, M)
        finally:
            lib.set_pair_rows(chosen)


def test_the_two_channel_choice_is_measured_once_into_the_tuning_file_or_set_by_the_environment(monkeypatch, tmp_path):
    """The 512-bit builds' choice comes from $SPECDEC_HOME/tuning.json, measured (both kinds of kernel run)
    when the file lacks it and read from it after; `SPECDEC_QGEMM_PAIRS` overrides it. (The measurement runs
    on any build: on the others the setting changes nothing.)"""
    isa = qgemm.best_isa()
    lib = qgemm.ops(isa)
    chosen = lib.pair_rows()
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    try:
        monkeypatch.setenv("SPECDEC_QGEMM_PAIRS", "2")
        assert tuning.pair_rows(isa, lib) == 2
        monkeypatch.setenv("SPECDEC_QGEMM_PAIRS", "4")
        with pytest.raises(ValueError, match="SPECDEC_QGEMM_PAIRS"):
            tuning.pair_rows(isa, lib)
        monkeypatch.delenv("SPECDEC_QGEMM_PAIRS")
        assert not (tmp_path / "tuning.json").exists()
        mask = tuning.pair_rows(isa, lib)  # measured
        key = f"{native.cpu_model()} / {isa}"
        assert json.loads((tmp_path / "tuning.json").read_text()) == {key: {"pair_rows": mask}}
        assert lib.pair_rows() == chosen  # measuring leaves the library's setting as it was
        (tmp_path / "tuning.json").write_text(json.dumps({key: {"pair_rows": 3 - mask}}))
        assert tuning.pair_rows(isa, lib) == 3 - mask  # read, not measured again
    finally:
        lib.set_pair_rows(chosen)


def test_every_build_quantizes_activations_to_the_same_bytes_even_at_special_values():
    K = 512
    x = torch.randn(6, K) * 3
    x[0] = 0.0  # a zero block
    x[1, 5] = float("inf")
    x[2, 300] = float("nan")  # skipped by the block's maximum, quantized to -127
    x[3] = torch.arange(K) * 0.5 - 128  # ties at .5 after scaling: round half to even
    x[4, :256] = 1e-40  # subnormals
    x[5, 7] = -3e38
    for bs in (32, 256):
        outs = [qgemm.ops(isa).quantize_acts(x, bs) for isa in ISAS]
        for other in outs[1:]:
            for a, b in zip(outs[0], other):  # quants, sums of 16, scales: byte for byte
                assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (bs, ISAS)
        q, _, d = outs[0]
        assert q[2].view(-1, bs)[300 // bs, 300 % bs] == -127 and torch.isfinite(d[2]).all()
        assert q[0].abs().sum() == 0 and (d[0] == 0).all()


def test_segments_and_bias_equal_separate_products():
    K = 256
    parts = [(random_blocks(12, 32, K, seed=3), 12), (random_blocks(14, 16, K, seed=4), 14), (random_blocks(8, 8, K, seed=5), 8)]
    bias = torch.randn(56)
    x = torch.randn(3, K, dtype=torch.bfloat16)
    fused = QuantLinear(parts, K, bias)(x)
    separate = torch.cat([qgemm.qmm(x.float(), [w], [t]) for w, t in parts], -1) + bias
    assert torch.equal(fused, separate.to(torch.bfloat16))
    ids = torch.tensor([0, 31, 32, 47, 55])
    rows = QuantLinear(parts, K).dequantize_rows(ids)
    assert torch.equal(rows[1], dequantize_rows(parts[0][0][31:32], 12, K)[0])
    assert torch.equal(rows[3], dequantize_rows(parts[1][0][15:16], 14, K)[0])
    assert torch.equal(rows[4], dequantize_rows(parts[2][0][7:8], 8, K)[0])


def test_bad_inputs_are_refused_clearly():
    w = random_blocks(12, 4, 256)
    with pytest.raises(RuntimeError, match="do not hold K"):
        qgemm.qmm(torch.randn(1, 512), [w], [12])
    with pytest.raises(RuntimeError, match="unsupported block type"):
        qgemm.qmm(torch.randn(1, 256), [w], [3])
    with pytest.raises(RuntimeError, match="bf16 or fp32"):
        qgemm.qmm(torch.randn(1, 256).half(), [w], [12])
    assert qgemm.qmm(torch.randn(0, 256), [w], [12]).shape == (0, 4)


def test_q8_0_quantizer_round_trips_within_half_a_step():
    w = torch.randn(6, 64)
    blocks = qgemm.quantize_q8_0(w)
    back = dequantize_rows(blocks, 8, 64)
    step = w.view(6, 2, 32).abs().amax(-1, keepdim=True) / 127
    # half a step, plus up to 127 times the rounding of the scale to fp16 (2^-11 relative)
    assert ((back.view(6, 2, 32) - w.view(6, 2, 32)).abs() <= step * (0.5 + 127 * 2**-11) + 1e-7).all()


def test_q4_0_quantizer_gives_ggufs_reference_bytes():
    """quantize_q4_0 against the gguf package's reference quantizer (ggml's), on values of every scale, zero
    blocks, constant blocks and blocks whose largest magnitudes tie in both signs; requantize_q4_0 (Q8_0 /
    Q5_0 blocks straight to Q4_0, in C++) gives the bytes of dequantizing then quantizing."""
    from gguf import GGMLQuantizationType, quants

    rng = np.random.default_rng(0)
    for scale in (1e-3, 1.0, 100.0):
        x = (rng.standard_normal((32, 256)) * scale).astype(np.float32)
        x[0, :32], x[1, :32], x[2, :32] = 0.0, 1.0, -1.0
        x[3, :2] = [5.0, -5.0]
        x[4, :2] = [-5.0, 5.0]
        ours = qgemm.quantize_q4_0(torch.from_numpy(x))
        assert np.array_equal(ours.numpy(), quants.quantize(x, GGMLQuantizationType.Q4_0)), scale
    for qtype in (8, 6):
        w = random_blocks(qtype, 40, 512, seed=qtype)
        assert torch.equal(qgemm.requantize_q4_0(w, qtype), qgemm.quantize_q4_0(dequantize_rows(w, qtype, 512)))
    with pytest.raises(RuntimeError, match="from Q8_0 or Q5_0"):
        qgemm.requantize_q4_0(random_blocks(12, 4, 256), 12)
    with pytest.raises(ValueError, match="multiple of 32"):
        qgemm.quantize_q4_0(torch.randn(2, 48))


def test_a_draft_requantized_to_q4_0_is_smaller_and_speculation_stays_exact(tmp_path):
    """`draft_quantization: q4_0`: every matrix of more bits than Q4_0 requantized (Q4_K kept), the
    output exactly the plain target's."""
    from specdec.api import LLM
    from specdec.config import SamplingParams
    from specdec.models.loading import load_quantized
    from specdec.models.qlinear import kernel_blocks
    from test_tokenizer import write_tiny_gguf

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, arch="qwen2", tied=True)
    _, model, _ = load_quantized(path, "q4_0", torch.float32)
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert linears and all(t == 2 for m in linears for t in m.types)
    q4k = random_blocks(12, 16, 256)
    assert kernel_blocks(q4k, 12, 256, requantize=2)[1] == 12  # already 4.5 bits a weight: kept
    assert kernel_blocks(random_blocks(14, 16, 256), 14, 256, requantize=2)[1] == 2
    with pytest.raises(ValueError, match="Q8_0 or Q4_0"):
        kernel_blocks(q4k, 12, 256, requantize=6)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = LLM(str(path), max_model_len=128).generate(["ab"], greedy)[0]
    spec = LLM(str(path), max_model_len=128, speculative_config={
        "model": str(path), "num_speculative_tokens": 3, "adaptive": False, "draft_quantization": "q4_0"})
    out = spec.generate(["ab"], greedy)[0]
    assert out.token_ids == plain.token_ids and out.metrics.num_drafts > 0


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_gguf_model_on_the_kernels_is_close_to_float_and_exact_under_speculation(tmp_path, arch):
    from specdec.api import LLM
    from specdec.config import SamplingParams
    from specdec.models.loading import load_checkpoint, load_quantized
    from specdec.models.llama import Transformer
    from test_tokenizer import write_tiny_gguf

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, arch=arch, tied=arch == "qwen2")  # F32 matrices: requantized to Q8_0 at load
    config, model, _ = load_quantized(path, "gguf", torch.float32)
    assert isinstance(model.lm_head, QuantLinear) and model.model.layers[0].self_attn.qkv_proj is not None
    _, state, _ = load_checkpoint(path, torch.float32)
    ref = Transformer.from_state_dict(config, state)
    tokens = torch.tensor([[3, 17, 40, 41, 9, 60]])
    pos = torch.arange(6)[None]
    ours = model(tokens, pos, model.new_cache(1, 64))
    theirs = ref(tokens, pos, ref.new_cache(1, 64))
    assert ((ours - theirs).norm() / theirs.norm()).item() < 0.05  # 8-bit weights and activations

    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = LLM(str(path), max_model_len=128).generate(["ab"], greedy)[0]
    spec = LLM(str(path), speculative_model=str(path), num_speculative_tokens=3, max_model_len=128)
    out = spec.generate(["ab"], greedy)[0]
    assert spec.quantization == "gguf" and out.token_ids == plain.token_ids
    assert out.metrics.num_drafts > 0 and out.metrics.num_accepted_tokens == out.metrics.num_draft_tokens


X16 = {2: "Q4_0", 6: "Q5_0", 12: "Q4_K", 14: "Q6_K"}
X16_BYTES = {2: 288, 6: 352, 12: 2368, 14: 3360}  # a block of 16 channels
X16_OTHER = {2: 6, 6: 8, 12: 14, 14: 12}  # another type of the same block size, in the file's layout


@pytest.mark.parametrize("qtype", sorted(X16), ids=list(X16.values()))
def test_16_channels_side_by_side_give_the_file_layouts_bits_for_any_rows_build_and_threads(qtype):
    """Q4_K / Q6_K / Q4_0 / Q5_0 repacked 16 channels side by side (the kernels with the channels in the lanes) against
    the file's layout: the same bits for 1-136 rows (Q6_K from 16 rows a block: the wide kernels that unpack each
    weight block once for all of them; 136: two blocks of rows), bf16 and fp32 activations, with a bias and next to
    other segments, one or two threads, on each build that runs here (AVX-512 and AVX2 kernels of their own, the
    portable loop elsewhere), and across builds."""
    K, N = 768, 48
    w = random_blocks(qtype, N, K, seed=5)
    w16, xtype = qgemm.repack_x16(w, qtype), qgemm.X16_TYPES[qtype]
    assert w16.shape == (N // 16, K // qgemm.BLOCK[qtype][0] * X16_BYTES[qtype])
    other = random_blocks(X16_OTHER[qtype], 16, K, seed=6)
    bias = torch.randn(N + 16)
    for isa in [i for i in ISAS if i != "generic"]:  # (the portable loop: against them below)
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(136, K, dtype=dtype)
            alone = torch.cat([qgemm.qmm(x[m:m + 1], [w16], [xtype], isa=isa) for m in range(136)])
            for M in (1, 2, 3, 4, 5, 7, 9, 13, 16, 17, 64, 131, 136):
                assert torch.equal(qgemm.qmm(x[:M], [w], [qtype], isa=isa), alone[:M]), (isa, dtype, M)
                assert torch.equal(qgemm.qmm(x[:M], [w16], [xtype], isa=isa), alone[:M]), (isa, dtype, M)
            both = qgemm.qmm(x[:6], [w16, other], [xtype, X16_OTHER[qtype]], bias, isa=isa)
            assert torch.equal(both, qgemm.qmm(x[:6], [w, other], [qtype, X16_OTHER[qtype]], bias, isa=isa)), isa
            threads = torch.get_num_threads()
            try:
                torch.set_num_threads(1)
                assert torch.equal(qgemm.qmm(x[:9], [w16], [xtype], isa=isa), alone[:9]), isa
            finally:
                torch.set_num_threads(threads)
    x = torch.randn(5, K)
    outs = [qgemm.qmm(x, [w16], [xtype], isa=isa) for isa in ISAS]
    assert all(torch.equal(qgemm.qmm(x, [w], [qtype]), o) for o in outs), ISAS


@pytest.mark.parametrize("qtype", sorted(X16), ids=list(X16.values()))
def test_16_channels_side_by_side_at_the_largest_integer_sums(qtype):
    """Every quant, scale and min at its largest (Q6_K: scales at -128 and 127; Q4_0 / Q5_0 also at their
    smallest, all bits 0), activations at +-127: the 16 channels' lanes at their bounds give the file
    layout's bits."""
    K, N = 2304, 32
    w = torch.full((N, K // qgemm.BLOCK[qtype][0], qgemm.BLOCK[qtype][1]), 0xFF, dtype=torch.uint8)
    if qtype in (2, 6):
        w[16:] = 0
    for off in FP16_FIELDS[qtype]:
        w[..., off:off + 2] = torch.tensor([0.01], dtype=torch.float16).view(torch.uint8)
    if qtype == 14:
        w[..., 192:208] = torch.tensor([-128, 127] * 8, dtype=torch.int8).view(torch.uint8)
    w = w.reshape(N, -1)
    w16 = qgemm.repack_x16(w, qtype)
    sign = torch.where(torch.arange(K) % 2 == 0, 1.0, -1.0)
    x = torch.stack([torch.ones(K), -torch.ones(K), sign, torch.ones(K)]).repeat(4, 1)
    for isa in ISAS:  # (AVX2: the i16 sums of a sub-block at their largest, 30480 for Q4_K and 32004 for Q6_K)
        for M in (1, 2, 4, 16):  # (16: Q6_K's wide kernels)
            y = qgemm.qmm(x[:M], [w16], [qgemm.X16_TYPES[qtype]], isa=isa)
            assert torch.equal(y, qgemm.qmm(x[:M], [w], [qtype], isa="generic")), (isa, M)
            assert y.abs().max() > 0


def test_wide_kernels_on_or_off_give_the_same_bits_and_the_switch_is_checked(monkeypatch):
    """`set_wide_rows` (SPECDEC_QGEMM_WIDE_ROWS): Q6_K's wide kernels from any row count, or never, give the
    bits of groups of 4 rows; a value that is not a row count is refused by name."""
    K, N = 512, 32
    w16 = qgemm.repack_x16(random_blocks(14, N, K, seed=8), 14)
    x = torch.randn(40, K)
    for isa in [i for i in ISAS if i != "generic"]:
        lib = qgemm.ops(isa)
        default = lib.wide_rows()
        try:
            outs = []
            for rows in (0, 1, 5, 16, 200):
                lib.set_wide_rows(rows)
                outs.append(qgemm.qmm(x, [w16], [qgemm.Q6_K_X16], isa=isa))
        finally:
            lib.set_wide_rows(default)
        assert all(torch.equal(o, outs[0]) for o in outs), isa
    monkeypatch.setenv("SPECDEC_QGEMM_WIDE_ROWS", "many")
    with pytest.raises(ValueError, match="SPECDEC_QGEMM_WIDE_ROWS"):
        qgemm.wide_rows()
    monkeypatch.setenv("SPECDEC_QGEMM_WIDE_ROWS", "0")
    assert qgemm.wide_rows() == 0


def test_16_channel_layouts_refuse_what_they_cannot_lay_out():
    for qtype in X16:
        with pytest.raises(RuntimeError, match="multiple of 16"):
            qgemm.repack_x16(random_blocks(qtype, 24, 512), qtype)
        w16 = qgemm.repack_x16(random_blocks(qtype, 16, 512), qtype)
        with pytest.raises(RuntimeError, match="do not hold K"):
            qgemm.qmm(torch.randn(1, 768), [w16], [qgemm.X16_TYPES[qtype]])
        with pytest.raises(RuntimeError, match="rows whole"):  # a row that ends inside a block
            qgemm.repack_x16(random_blocks(qtype, 16, 512)[:, :-1], qtype)
    with pytest.raises(ValueError, match="no 16-channel layout"):
        qgemm.repack_x16(random_blocks(8, 16, 512), 8)


def test_quant_linear_lays_out_16_channels_as_the_build_says_and_keeps_the_bits(monkeypatch):
    K = 512
    parts = [(random_blocks(12, 32, K, seed=7), 12), (random_blocks(14, 16, K, seed=8), 14),
             (random_blocks(12, 8, K, seed=9), 12), (random_blocks(8, 16, K, seed=10), 8),
             (random_blocks(6, 32, K, seed=11), 6), (random_blocks(2, 16, K, seed=12), 2)]
    x = torch.randn(3, K, dtype=torch.bfloat16)
    monkeypatch.setenv("SPECDEC_QGEMM_Q5_0_AS_Q8_0", "0")  # (the file's layout for Q5_0 too: see the next test)
    monkeypatch.setenv("SPECDEC_QGEMM_X16", "0")
    plain = QuantLinear(parts, K)
    monkeypatch.setenv("SPECDEC_QGEMM_X16", "1")
    mixed = QuantLinear(parts, K)
    assert plain.kernel_types == [12, 14, 12, 8, 6, 2]
    # 8 channels are not a block of 16; Q8_0 keeps the file's layout
    assert mixed.kernel_types == [qgemm.Q4_K_X16, qgemm.Q6_K_X16, 12, 8, qgemm.Q5_0_X16, qgemm.Q4_0_X16]
    assert torch.equal(plain(x), mixed(x))
    ids = torch.tensor([1, 40, 50, 60])
    assert torch.equal(mixed.dequantize_rows(ids), plain.dequantize_rows(ids))  # from the file's blocks
    assert torch.equal(mixed.select_rows(ids)(x), plain.select_rows(ids)(x))
    monkeypatch.setenv("SPECDEC_QGEMM_X16", "2")
    with pytest.raises(ValueError, match="SPECDEC_QGEMM_X16"):
        QuantLinear(parts, K)


def test_q5_0_widened_to_q8_0_gives_the_weights_and_the_bits_of_q5_0(monkeypatch):
    """`widen_q5_0`: each block's scale and its weights (5-bit quant - 16) as Q8_0; a Q8_0 product of them is
    the Q5_0 product bit for bit, on every build, for any rows; QuantLinear reads them where the build says."""
    K = 800  # 25 blocks: the 512-bit kernels' groups of 8, a pair and an odd one
    w = random_blocks(6, 24, K, seed=5)
    wide = qgemm.widen_q5_0(w)
    assert wide.shape == (24, K // 32 * 34)
    raw = w.numpy().reshape(24, K // 32, 22)
    high = raw[..., 2:6].copy().view(np.uint32)[..., 0]
    quants = np.concatenate([raw[..., 6:] & 0x0F, raw[..., 6:] >> 4], -1).astype(np.int16)
    quants |= (((high[..., None] >> np.arange(32, dtype=np.uint32)) & 1) << 4).astype(np.int16)
    blocks = wide.numpy().reshape(24, K // 32, 34)
    assert np.array_equal(blocks[..., :2], raw[..., :2])  # the scale as it was
    assert np.array_equal(blocks[..., 2:].view(np.int8), quants - 16)
    assert torch.equal(dequantize_rows(wide, 8, K), dequantize_rows(w, 6, K))
    for M in (1, 2, 5, 11, 40):
        x = torch.randn(M, K)
        want = qgemm.qmm(x, [w], [6], isa="generic")
        for isa in ISAS:
            assert torch.equal(qgemm.qmm(x, [wide], [8], isa=isa), want), (isa, M)
    parts = [(w, 6), (random_blocks(8, 8, K, seed=6), 8)]
    x = torch.randn(3, K, dtype=torch.bfloat16)
    monkeypatch.setenv("SPECDEC_QGEMM_X16", "0")
    monkeypatch.setenv("SPECDEC_QGEMM_Q5_0_AS_Q8_0", "0")
    plain = QuantLinear(parts, K)
    monkeypatch.setenv("SPECDEC_QGEMM_Q5_0_AS_Q8_0", "1")
    widened = QuantLinear(parts, K)
    assert (plain.types, widened.types, widened.kernel_types) == ([6, 8], [8, 8], [8, 8])  # (no Q5_0 kept)
    assert torch.equal(plain(x), widened(x))
    ids = torch.tensor([0, 7, 30])
    assert torch.equal(widened.dequantize_rows(ids), plain.dequantize_rows(ids))  # from the Q8_0 copy
    assert torch.equal(widened.select_rows(ids)(x), plain.select_rows(ids)(x))
    monkeypatch.delenv("SPECDEC_QGEMM_Q5_0_AS_Q8_0")
    assert qgemm.widens_q5_0() == (qgemm.best_isa() == "avx2")  # by default: on the AVX2 build only
    monkeypatch.setenv("SPECDEC_QGEMM_Q5_0_AS_Q8_0", "yes")
    with pytest.raises(ValueError, match="SPECDEC_QGEMM_Q5_0_AS_Q8_0"):
        QuantLinear(parts, K)
    with pytest.raises(RuntimeError, match="Q5_0 blocks"):
        qgemm.widen_q5_0(w[:, :-1])


@pytest.mark.real
def test_real_target_rows_are_invariant_for_every_block_type_in_the_files():
    """The default pair's own tensors, one of each (type, shape): rows alone vs rows in passes of 2-64."""
    from specdec.models.gguf_file import GGUFFile
    from specdec.models.store import KNOWN_MODELS, gguf_path, pull

    seen = set()
    for name in ("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"):
        pull(name, progress=False)
        for t in GGUFFile(gguf_path(KNOWN_MODELS[name])).tensors:
            key = (int(t.tensor_type), tuple(t.shape))
            if int(t.tensor_type) not in qgemm.SUPPORTED_TYPES or len(t.shape) != 2 or key in seen:
                continue
            seen.add(key)
            w = torch.from_numpy(np.asarray(t.data))[:96]  # 96 output channels of it
            x = torch.randn(64, int(t.shape[0]), dtype=torch.bfloat16)
            alone = torch.cat([qgemm.qmm(x[m:m + 1], [w], [int(t.tensor_type)]) for m in range(64)])
            for M in (2, 3, 6, 9, 64):
                assert torch.equal(qgemm.qmm(x[:M], [w], [int(t.tensor_type)]), alone[:M]), (t.name, M)
            if int(t.tensor_type) in qgemm.X16_TYPES:  # and laid out 16 channels side by side
                w16, xtype = qgemm.repack_x16(w, int(t.tensor_type)), qgemm.X16_TYPES[int(t.tensor_type)]
                for M in (1, 2, 3, 6, 9, 64):
                    assert torch.equal(qgemm.qmm(x[:M], [w16], [xtype]), alone[:M]), (t.name, M)
            if int(t.tensor_type) == 6:  # and read as Q8_0
                for M in (1, 2, 3, 6, 9, 64):
                    assert torch.equal(qgemm.qmm(x[:M], [qgemm.widen_q5_0(w)], [8]), alone[:M]), (t.name, M)
            ref = reference(x[:4].float(), w, int(t.tensor_type))
            y = qgemm.qmm(x[:4].float(), [w], [int(t.tensor_type)]).double()
            assert torch.allclose(y, ref, rtol=2e-5, atol=2e-5 * ref.abs().max().item()), t.name
    assert {t for t, _ in seen} >= {8, 6, 12, 14}  # Q8_0, Q5_0, Q4_K and Q6_K all covered (and laid out)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_rope_is_bit_identical_to_the_float_path(dtype):
    from specdec.models.llama import rotate_half

    x = torch.randn(2, 5, 24, dtype=dtype)[..., :16].reshape(2, 5, 2, 8)  # strided, as a split of qkv is
    angles = torch.randn(2, 5, 4)
    emb = torch.cat([angles, angles], -1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    ref = x * cos.unsqueeze(2) + rotate_half(x) * sin.unsqueeze(2)
    assert torch.equal(qgemm.ops().rope(x, cos, sin), ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_rms_norm_matches_the_float_path_and_is_row_invariant(dtype):
    from specdec.models.llama import RMSNorm

    norm = RMSNorm(1536, 1e-6)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.1)
    norm = norm.to(dtype)
    x = (torch.randn(9, 1536) * 3).to(dtype)
    ref = norm(x)
    norm.fused = True
    y = norm(x)
    step = 2.0 ** -7 if dtype == torch.bfloat16 else 1e-5  # at most one bf16 rounding step apart
    assert torch.allclose(y.float(), ref.float(), rtol=2 * step, atol=1e-6)
    assert torch.equal(torch.cat([norm(x[i:i + 1]) for i in range(9)]), y)


# ------------------------------------------------------------------------------------------- attention
def attention_case(dtype, B=2, T=5, H=12, KV=2, D=64, capacity=256, lengths=(100, 37), seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H * D + 8, generator=g).to(dtype)[..., :H * D].view(B, T, H, D)  # strided, as a split
    keys = torch.randn(B, KV, capacity, D, generator=g).to(dtype)
    values = torch.randn(B, KV, capacity, D, generator=g).to(dtype)
    S = 192
    visible = torch.zeros(B, T, S, dtype=torch.bool)
    for b, n in enumerate(lengths):
        for t in range(T):
            visible[b, t, :n + t + 1] = True  # the committed keys and the new ones up to itself
    return q, keys, values, visible


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_attention_equals_softmax_attention_in_float64(dtype):
    q, keys, values, visible = attention_case(dtype)
    out = qgemm.ops().attention(q, keys, values, visible, None)
    B, T, H, D = q.shape
    G = H // keys.shape[1]
    ref = torch.empty(B, T, H, D, dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            seen = visible[b, t].nonzero()[:, 0]
            for h in range(H):
                k, v = keys[b, h // G, seen].double(), values[b, h // G, seen].double()
                ref[b, t, h] = torch.softmax(k @ q[b, t, h].double() / D ** 0.5, -1) @ v
    tol = 2.0 ** -8 if dtype == torch.bfloat16 else 1e-6  # the output's own rounding
    assert torch.allclose(out.double(), ref, rtol=tol, atol=tol)


def test_attention_is_row_invariant_by_query_pass_width_and_threads():
    q, keys, values, visible = attention_case(torch.bfloat16)
    out = qgemm.ops().attention(q, keys, values, visible, None)
    wide = torch.cat([visible, torch.zeros(2, 5, 64, dtype=torch.bool)], -1)  # more (masked) key slots
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = qgemm.ops().attention(q, keys, values, visible, None)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one_thread, out) and torch.equal(qgemm.ops().attention(q, keys, values, wide, None), out)
    for b in range(2):
        for t in range(5):  # each query alone, as a one-token decoding step computes it (its row first)
            alone = qgemm.ops().attention(q[b:b + 1, t:t + 1], keys[b:b + 1], values[b:b + 1],
                                          visible[b:b + 1, t:t + 1, :101 + t], None)
            assert torch.equal(alone[0, 0], out[b, t]), (b, t)
    # every build computes the same bits, but the AMX build's bf16 tiles (a recipe of their own, whose
    # invariances tests/test_attention.py checks there)
    portable = [isa for isa in ISAS if not qgemm.ops(isa).attention_tiles(q.shape[-1])]
    outs = [qgemm.ops(isa).attention(q, keys, values, visible, None) for isa in portable]
    assert all(torch.equal(outs[0], o) for o in outs[1:]), portable


def test_tree_attention_reads_each_nodes_path_as_the_chain_of_that_path():
    """A node whose path's keys sit at scattered slots (key_index) gets the bits of the same query over a
    chain holding those keys in order (what decoding the path token by token computes)."""
    q, keys, values, _ = attention_case(torch.float32, B=1, T=1, lengths=(50,))
    path = [3, 7, 8, 20, 51, 60, 55]  # the node's keys in order: committed ones, then its ancestors, itself
    S = 64
    key_index = torch.zeros(1, 1, S, dtype=torch.long)
    key_index[0, 0, :len(path)] = torch.tensor(path)
    visible = torch.zeros(1, 1, S, dtype=torch.bool)
    visible[0, 0, :len(path)] = True
    tree = qgemm.ops().attention(q, keys, values, visible, key_index)
    chain_k, chain_v = keys.clone(), values.clone()
    chain_k[:, :, :len(path)], chain_v[:, :, :len(path)] = keys[:, :, path], values[:, :, path]
    chain = qgemm.ops().attention(q, chain_k, chain_v, visible, None)
    assert torch.equal(tree, chain)


def test_attention_refuses_bad_inputs_clearly():
    q, keys, values, visible = attention_case(torch.float32)
    with pytest.raises(RuntimeError, match="one dtype"):
        qgemm.ops().attention(q.bfloat16(), keys, values, visible, None)
    with pytest.raises(RuntimeError, match="bool"):
        qgemm.ops().attention(q, keys, values, visible.int(), None)
    with pytest.raises(RuntimeError, match="more key slots"):
        qgemm.ops().attention(q, keys, values, torch.ones(2, 5, 500, dtype=torch.bool), None)
    with pytest.raises(RuntimeError, match="outside the cache"):
        qgemm.ops().attention(q, keys, values, visible, torch.full(visible.shape, 999, dtype=torch.long))


@pytest.mark.parametrize("dtype, residual", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                             (torch.bfloat16, torch.float32)], ids=["fp32", "bf16", "fp32-residual"])
def test_a_fused_decoder_layer_computes_the_bits_of_the_unfused_one(tmp_path, dtype, residual):
    """The whole layer as one op (`decoder_layer`) against the same layer's modules, pass for pass: a prompt,
    a chain, a tree, two rows of different lengths; logits and every entry of the rows' pages bit for bit."""
    from specdec.models.loading import load_quantized
    from test_tokenizer import write_tiny_gguf

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, arch="qwen2", tied=True)
    _, model, _ = load_quantized(path, "gguf", dtype, residual_dtype=residual)
    assert model.residual_dtype == (None if residual == dtype else residual) and model.dtype == dtype
    layers = model.model.layers
    assert all(layer.fused_args is not None for layer in layers)
    fused_args = [layer.fused_args for layer in layers]

    def run(fused: bool):
        for layer, args in zip(layers, fused_args):
            layer.fused_args = args if fused else None
        cache = model.new_cache(2, 64)
        outs = [model(torch.tensor([[3, 17, 40, 41, 9, 60], [5, 6, 7, 8, 9, 10]]), torch.arange(6).expand(2, 6), cache)]
        cache.advance(0, 6)
        cache.advance(1, 4)  # rows of different lengths: explicit write slots
        outs.append(model(torch.tensor([[11, 12, 13], [14, 15, 16]]), torch.tensor([[6, 7, 8], [4, 5, 6]]), cache))
        cache.advance(0, 3)
        cache.advance(1, 3)
        tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
        outs.append(model(torch.tensor([[20, 21, 22, 23]] * 2), torch.tensor([[9, 10, 10, 11], [7, 8, 8, 9]]), cache,
                          mask=tree.expand(2, 4, 4)))
        return outs, cache

    (fused, fc), (plain, pc) = run(True), run(False)
    for a, b in zip(fused, plain):
        assert torch.equal(a, b)
    held = sorted({page for row in fc.pages for page in row})  # (pages never handed out hold any bits)
    assert fc.pages == pc.pages and held
    for a, b in zip(fc.keys + fc.values, pc.keys + pc.values):
        assert torch.equal(a[held], b[held])
