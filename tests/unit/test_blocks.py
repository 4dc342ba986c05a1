"""The block kernel (`actors/kernels/blocks.cpp`, `native.BlockWeight`): GGUF Q4_1 / Q8_0 blocks
times Q8-quantized activations, the same kernel at every width.

At every ISA path this CPU runs (scalar, AVX2, AVX-512 VNNI, AMX; each forced as SPECD_ISA would), odd shapes
(outputs not a multiple of the 16-wide tile, an odd number of 32-input blocks, rows across the
kernel's 4-row groups and 32-row sweeps): every path gives the same bits, every row the bits it gets
alone (and at one thread or two), all within the activation rounding of the fp32 reference. The
fused calls (RMSNorm into the quantization, a residual add) are the unfused calls' bits. A plausible
bug (wide calls dispatched to another kernel) fails the row check."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from actors import cpu, kernels, native
from actors.llama import LlamaRunner
from actors.models import gguf_source

SHAPES = [(17, 32), (40, 96), (33, 160)]  # (N, K): N tails, K of 1, 3 and 5 blocks
ROWS = [1, 3, 5, 33]


@pytest.fixture(autouse=True)
def block_kernel_on(monkeypatch):
    """The kernel itself is under test, even in `make test-fallbacks` (SPECD_DISABLE=all)."""
    monkeypatch.setenv(cpu.DISABLE_ENV, ",".join(sorted(cpu.forced_off() - {"block-kernel"})))
    monkeypatch.delenv(kernels.ISA_ENV, raising=False)
    cpu.reset()
    yield
    monkeypatch.undo()
    cpu.reset()


def _blocks(kind: str, n: int, k: int, seed: int = 0) -> tuple:
    """Random GGUF blocks of `kind` [n, k] and the fp32 weight they hold (the kernels' trial weights)."""
    return kernels._trial_weights(torch.Generator().manual_seed(seed), kind, n, k)


def _paths() -> list[int]:
    return list(range(kernels.blocks_extension().isa() + 1))


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_every_isa_path_and_width_computes_the_same_bits(kind):
    assert kernels.blocks_extension() is not None, cpu.probe("block-kernel").reason
    for n, k in SHAPES:
        blocks, dense = _blocks(kind, n, k)
        w = native.BlockWeight(kind, blocks, torch.float32)
        assert torch.equal(w.dequantize(), dense)  # the tiles hold the GGUF's weights exactly
        x = torch.randn(max(ROWS), k, generator=torch.Generator().manual_seed(n))
        ref = F.linear(x, dense)
        outs = {}
        for path in _paths():
            w.path = path
            alone = torch.cat([w(x[i:i + 1]) for i in range(x.shape[0])])
            for m in ROWS:
                assert torch.equal(w(x[:m]), alone[:m]), (kind, n, k, path, m)
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                assert torch.equal(w(x), alone), "one thread"
            finally:
                torch.set_num_threads(threads)
            outs[path] = alone
            # Q8 activations: per block of 32 each input is off by at most half a step of max|x| / 127
            bound = (x.abs().view(x.shape[0], -1, 32).amax(-1) / 254) @ dense.abs().view(n, -1, 32).sum(-1).T
            assert ((alone - ref).abs() <= bound * 1.01 + 1e-5).all(), (kind, n, k, path)
        assert all(torch.equal(o, outs[0]) for o in outs.values()), f"ISA paths disagree: {kind} {n}x{k}"


def test_fused_norm_and_residual_are_the_unfused_calls_bits():
    ext = kernels.blocks_extension()
    n, k = 40, 96
    w = native.BlockWeight("Q4_1", _blocks("Q4_1", n, k)[0], torch.float32)
    g = torch.Generator().manual_seed(3)
    x, res, nw = torch.randn(5, k, generator=g), torch.randn(5, n, generator=g), torch.rand(k, generator=g) + 0.5
    normed = ext.rms_norm(x, nw, 1e-5)
    torch.testing.assert_close(normed, F.rms_norm(x, (k,), nw, 1e-5), rtol=1e-5, atol=1e-6)
    for path in _paths():
        w.path = path
        assert torch.equal(w(x, norm=nw, eps=1e-5), w(normed))
        assert torch.equal(w(x, residual=res), res + w(x))
        assert torch.equal(w(x[None], residual=res[None]), (res + w(x))[None])  # [..., K] in, [..., N] out
    assert torch.equal(ext.rms_norm(x[:1], nw, 1e-5), normed[:1])  # RMSNorm is row-invariant too


def test_a_width_dependent_dispatch_fails_the_row_check(monkeypatch):
    """The check above can fail: a dispatcher that sends wide calls to another kernel (a dense GEMM
    over the dequantised weight, as mixed GEMV/GEMM backends do) gives rows other bits than alone."""
    n, k = 40, 96
    w = native.BlockWeight("Q4_1", _blocks("Q4_1", n, k)[0], torch.float32)
    real = native.BlockWeight.__call__

    def dispatch(self, x, *a, **kw):
        return F.linear(x, self.dequantize()) if x.shape[0] > 1 else real(self, x, *a, **kw)
    monkeypatch.setattr(native.BlockWeight, "__call__", dispatch)
    x = torch.randn(4, k, generator=torch.Generator().manual_seed(5))
    alone = torch.cat([w(x[i:i + 1]) for i in range(4)])
    assert not torch.equal(w(x), alone)


def test_isa_override_selects_a_path_and_refuses_what_it_cannot(monkeypatch):
    best = kernels.blocks_extension().isa()
    monkeypatch.setenv(kernels.ISA_ENV, "scalar")
    assert kernels.isa_path() == 0
    if best >= 1:
        monkeypatch.setenv(kernels.ISA_ENV, "avx2")
        assert kernels.isa_path() == 1
        assert native.BlockWeight("Q8_0", _blocks("Q8_0", 16, 32)[0], torch.float32).path == 1
    monkeypatch.setenv(kernels.ISA_ENV, "sse9")
    with pytest.raises(ValueError, match="SPECD_ISA='sse9': expected one of"):
        kernels.isa_path()
    cpu.reset()
    assert not cpu.available("block-kernel") and "SPECD_ISA" in cpu.probe("block-kernel").reason
    if best < 2:
        monkeypatch.setenv(kernels.ISA_ENV, "avx512")
        with pytest.raises(ValueError, match="this CPU runs at most"):
            kernels.isa_path()


def test_the_fused_native_runner_computes_the_model(smollm2, cpu_paths_off):
    """The fused stack (every layer in one call: RMSNorm folded into the quantization, RoPE + KV
    write + attention by the attention kernel) computes the dequantised fp32 model up to Q8
    activation rounding: a wrong rotation, a skipped norm or a misplaced KV write would not stay
    this close; and so does the per-layer fused path where the attention kernel is off."""
    ids = torch.tensor([[1, 9690, 314, 253, 1826, 3514, 28, 441, 9110, 260, 4457, 282, 2330, 30]])
    dense = LlamaRunner(smollm2.model, num_layers=4)
    want = dense.logits(dense.forward(dense.new_cache(1, 32), [0], ids))[0].float()
    fused = native.apply(LlamaRunner(smollm2.model, num_layers=4), gguf_source("smollm2")).make_exact()
    assert fused.fused is not None
    cache = fused.new_cache(1, 32)
    got = torch.cat([fused.logits(fused.forward(cache, [0], ids[:, :5]))[0],
                     fused.logits(fused.forward(cache, [0], ids[:, 5:]))[0]]).float()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.85
    assert torch.nn.functional.cosine_similarity(got, want, dim=-1).min() > 0.99
    # without the attention kernel: four block-kernel calls per layer around SDPA, the same model
    cpu_paths_off("attn-kernel")
    loose = native.apply(LlamaRunner(smollm2.model, num_layers=4), gguf_source("smollm2"))
    assert loose.fused is not None and not loose.exact
    other = loose.logits(loose.forward(loose.new_cache(1, 32), [0], ids))[0].float()
    assert torch.nn.functional.cosine_similarity(other, got, dim=-1).min() > 0.999


def test_amx_is_taken_only_after_its_trial_in_a_child_process(monkeypatch, tmp_path):
    """A machine whose AMX trial failed (the child died or disagreed: its marker says so) runs the
    AVX-512 path; where the CPU has AMX, the real trial (a child process) passed."""
    if kernels.blocks_extension().isa() < kernels.ISAS.index("amx"):
        assert kernels.isa_path() <= kernels.ISAS.index("avx512")
        return
    assert kernels.amx_runs() and kernels.isa_path() == kernels.ISAS.index("amx")
    monkeypatch.setitem(kernels._BUILD_DIRS, "blocks", tmp_path)
    (tmp_path / "amx-fails").write_text("exit code -4: Illegal instruction")
    kernels.amx_runs.cache_clear()
    try:
        assert kernels.isa_path() == kernels.ISAS.index("avx512")
    finally:
        monkeypatch.undo()
        kernels.amx_runs.cache_clear()
