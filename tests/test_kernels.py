"""Every kernel against its reference, forward and backward, and the backend selection logic.

CPU runs the fallbacks (fp32: max abs ≤ 1e-5; bf16 against the fp32 reference: ≤ 2e-2 relative to the
output scale); tests of flash-attn and apex run only on CUDA with the package installed and skip otherwise.
"""
import pytest
import torch

from kernels import adamw, attention, cross_entropy, norm, rope, swiglu
from tests.flash_double import FlashAttnDouble

CUDA = torch.cuda.is_available()
needs_flash = pytest.mark.skipif(not attention.flash_available(), reason="flash-attn needs CUDA and the gpu extra")
needs_hopper = pytest.mark.skipif(not (CUDA and torch.cuda.get_device_capability()[0] == 9),
                                  reason="cuDNN attention is preferred on Hopper (sm90) GPUs only")
needs_apex = pytest.mark.skipif(not norm.apex_available(), reason="apex needs CUDA and a --cuda_ext build")
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
DTYPES = [torch.float32, torch.bfloat16]


def rand(*shape, dtype=torch.float32, seed=0, device="cpu"):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device, dtype).requires_grad_()


def run_with_grads(fn, *inputs, seed=1):
    out = fn(*inputs)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.dtype)
    out.backward(grad_out.to(out.device))
    grads = [x.grad.float().clone() for x in inputs]
    for x in inputs:
        x.grad = None
    return [out.float().detach()] + grads


def assert_close(got, want, dtype, what):
    for i, (a, b) in enumerate(zip(got, want)):
        scale = max(b.abs().max().item(), 1.0) if dtype != torch.float32 else 1.0
        diff = (a - b).abs().max().item()
        assert diff <= TOL[dtype] * scale, f"{what}[{i}]: max abs diff {diff}"


# ---- attention -------------------------------------------------------------------------------------------

ATTN_SHAPES = [(2, 4, 4, 8, 16), (1, 8, 2, 12, 8), (2, 6, 1, 5, 16)]  # b, q heads, kv heads, s, d


def segments(b, s):
    ids = torch.zeros(b, s, dtype=torch.long)
    ids[:, s // 3:] = 1
    ids[-1, 2 * s // 3:] = 2
    return ids


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", ATTN_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("variant", ["causal", "window", "documents", "alibi"])
def test_sdpa_matches_reference(dtype, shape, variant):
    b, hq, hkv, s, d = shape
    q, k, v = rand(b, hq, s, d, seed=1), rand(b, hkv, s, d, seed=2), rand(b, hkv, s, d, seed=3)
    kw = {"window": {"window": 3}, "documents": {"segment_ids": segments(b, s)},
          "alibi": {"bias": attention.alibi_bias(attention.alibi_slopes(hq), s)}}.get(variant, {})
    want = run_with_grads(lambda *t: attention.attention_reference(*t, **kw), q, k, v)
    if variant == "alibi":  # what the model passes: the slopes; the bias is built only for non-flash backends
        kw = {"slopes": attention.alibi_slopes(hq)}
    low = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    got = run_with_grads(lambda *t: attention.causal_attention(*t, backend="sdpa", **kw), *low)
    assert_close(got, want, dtype, f"sdpa {variant}")


def test_reference_equals_explicit_loops():
    """The reference's masks (causal, window, documents) against a per-query loop over allowed keys."""
    b, h, s, d, window = 2, 2, 7, 4, 3
    q, k, v = (torch.randn(b, h, s, d, generator=torch.Generator().manual_seed(i)) for i in range(3))
    ids = segments(b, s)
    out = attention.attention_reference(q, k, v, window=window, segment_ids=ids)
    for bi in range(b):
        for i in range(s):
            keys = [j for j in range(i + 1) if i - j < window and ids[bi, j] == ids[bi, i]]
            scores = torch.einsum("hd,hnd->hn", q[bi, :, i], k[bi, :, keys]) / d ** 0.5
            want = torch.einsum("hn,hnd->hd", torch.softmax(scores, -1), v[bi, :, keys])
            torch.testing.assert_close(out[bi, :, i], want, rtol=0, atol=1e-6, check_dtype=False)


def test_document_offsets_are_computed_once_per_segment_ids_tensor():
    ids = torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 2, 2]])
    first = attention._cu_seqlens(ids)
    assert first[0].tolist() == [0, 2, 5, 6, 8, 10] and first[1] == 3
    assert attention._cu_seqlens(ids) is first  # every layer after the first: no recomputation
    ids[0, 4] = 2  # changed in place: recomputed
    assert attention._cu_seqlens(ids)[0].tolist() == [0, 2, 4, 5, 6, 8, 10]
    same_values = ids.clone()
    assert attention._cu_seqlens(same_values) is not first and attention._cu_seqlens(same_values)[1] == 2


def test_gqa_equals_repeated_heads():
    q, k, v = rand(2, 8, 6, 8, seed=1), rand(2, 2, 6, 8, seed=2), rand(2, 2, 6, 8, seed=3)
    gqa = attention.causal_attention(q, k, v, backend="sdpa")
    mha = attention.causal_attention(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), backend="sdpa")
    torch.testing.assert_close(gqa, mha, rtol=0, atol=1e-6, check_dtype=False)


@needs_flash
@pytest.mark.parametrize("variant", ["causal", "window", "documents", "alibi"])
def test_flash_matches_reference_on_cuda(variant):
    b, hq, hkv, s, d = 2, 8, 2, 64, 64
    q, k, v = rand(b, hq, s, d, seed=1), rand(b, hkv, s, d, seed=2), rand(b, hkv, s, d, seed=3)
    ids = segments(b, s)
    slopes = attention.alibi_slopes(hq)
    kw = {"window": {"window": 16}, "documents": {"segment_ids": ids},
          "alibi": {"bias": attention.alibi_bias(slopes, s)}}.get(variant, {})
    want = run_with_grads(lambda *t: attention.attention_reference(*t, **kw), q, k, v)
    low = [t.detach().cuda().to(torch.bfloat16).requires_grad_() for t in (q, k, v)]
    if variant == "documents":
        kw = {"segment_ids": ids.cuda()}
    if variant == "alibi":  # bf16 slopes on purpose: flash-attn needs fp32 ones, causal_attention converts
        kw = {"slopes": slopes.cuda().to(torch.bfloat16)}
    got = run_with_grads(lambda *t: attention.causal_attention(*t, backend="flash", **kw), *low)
    assert_close([g.cpu() for g in got], want, torch.bfloat16, f"flash {variant}")


@pytest.mark.parametrize("variant", ["causal", "window", "documents", "alibi", "documents+window+alibi"])
def test_flash_call_follows_the_flash_attn_api(monkeypatch, variant):
    """CPU check of the flash path's wiring against a double of the library (the CUDA test above checks the
    real kernel): the same outputs and gradients as the reference for every option."""
    double = FlashAttnDouble()
    monkeypatch.setattr(attention, "_flash_attn_func", double.flash_attn_func)
    monkeypatch.setattr(attention, "_flash_attn_varlen_func", double.flash_attn_varlen_func)
    b, hq, hkv, s, d = 2, 4, 2, 9, 8
    q, k, v = rand(b, hq, s, d, seed=1), rand(b, hkv, s, d, seed=2), rand(b, hkv, s, d, seed=3)
    ids, slopes = segments(b, s), attention.alibi_slopes(hq)
    ref_kw, flash_kw = {}, {}
    if "window" in variant:
        ref_kw["window"] = flash_kw["window"] = 3
    if "documents" in variant:
        ref_kw["segment_ids"] = flash_kw["segment_ids"] = ids
    if "alibi" in variant:
        ref_kw["bias"], flash_kw["slopes"] = attention.alibi_bias(slopes, s), slopes
    want = run_with_grads(lambda *t: attention.attention_reference(*t, **ref_kw), q, k, v)
    got = run_with_grads(lambda *t: attention.attention_flash(*t, **flash_kw), q, k, v)
    assert_close(got, want, torch.float32, f"flash wiring {variant}")
    window_size = (2, 0) if "window" in variant else (-1, -1)
    if "documents" in variant:
        assert double.calls == [("varlen", window_size, [3, 6, 3, 3, 3])]
    else:
        assert double.calls == [("dense", window_size)]


def test_document_offsets_come_from_the_host_copy(monkeypatch):
    """A micro-batch copied to the device brings its documents' offsets, computed from the host copy: the varlen
    kernel's longest-document argument then needs no read back from the device. On the meta device (shapes,
    no values) computing them there would fail; here they come back equal to the host's."""
    from parallel.micro_batch import MicroBatch
    double = FlashAttnDouble()
    monkeypatch.setattr(attention, "_flash_attn_varlen_func", double.flash_attn_varlen_func)
    ids = segments(2, 9)
    host = MicroBatch(torch.zeros(2, 10, dtype=torch.long), segment_ids=ids)
    on_device = host.to(torch.device("meta"))
    cu, longest = attention._cu_seqlens(on_device.segment_ids)
    want_cu, want_longest = attention._compute_cu_seqlens(ids)
    assert cu.device.type == "meta" and cu.shape == want_cu.shape and longest == want_longest == 6


def test_attention_backend_selection():
    q = torch.randn(1, 2, 4, 8)
    assert attention.select_backend("auto", q) == "sdpa"
    assert attention.select_backend("reference", q) == "reference"
    assert attention.select_backend("sdpa", q) == "sdpa"
    with pytest.raises(RuntimeError, match="attention_backend=flash needs"):
        attention.select_backend("flash", q)  # CPU fp32 tensors: refused whether or not flash-attn is installed
    with pytest.raises(ValueError, match="not one of"):
        attention.select_backend("xformers", q)
    with pytest.raises(RuntimeError, match="attention_backend=cudnn needs CUDA tensors in bf16/fp16"):
        attention.select_backend("cudnn", q)
    if attention.flash_available():
        on_hopper = torch.cuda.get_device_capability()[0] == 9
        assert attention.select_backend("auto", q.cuda().bfloat16()) == ("cudnn" if on_hopper else "flash")
        assert attention.select_backend("auto", q.cuda()) == "sdpa"  # fp32: flash-attn has no fp32 kernel


class FakeCudaQuery:
    """What select_backend reads of a query, as a bf16 CUDA tensor would answer (CPU machines have none)."""
    is_cuda, dtype = True, torch.bfloat16


@pytest.mark.parametrize("hopper", [True, False], ids=["hopper", "other-gpu"])
@pytest.mark.parametrize("flash_installed", [True, False], ids=["flash-attn", "no-flash-attn"])
def test_auto_attention_prefers_cudnn_on_hopper_for_plain_causal(monkeypatch, hopper, flash_installed):
    monkeypatch.setattr(attention, "is_hopper", lambda t: hopper)
    monkeypatch.setattr(attention, "_flash_attn_func", object() if flash_installed else None)
    q = FakeCudaQuery()
    fallback = "flash" if flash_installed else "sdpa"
    assert attention.select_backend("auto", q, plain=True) == ("cudnn" if hopper else fallback)
    assert attention.select_backend("auto", q, plain=False) == fallback  # documents/window/ALiBi: not cuDNN
    assert attention.select_backend("cudnn", q, plain=False) == "cudnn"  # asked for: always honoured


@pytest.mark.parametrize("variant", ["causal", "window", "documents", "alibi"])
def test_cudnn_preference_is_sdpa_with_the_same_numbers(variant):
    """On CPU the priority order changes nothing: the wrapper must pass every argument through, also when
    torch.compile traces its context manager."""
    b, hq, hkv, s, d = ATTN_SHAPES[0]
    q, k, v = rand(b, hq, s, d, seed=1), rand(b, hkv, s, d, seed=2), rand(b, hkv, s, d, seed=3)
    kw = {"window": {"window": 3}, "documents": {"segment_ids": segments(b, s)},
          "alibi": {"bias": attention.alibi_bias(attention.alibi_slopes(hq), s)}}.get(variant, {})
    want = run_with_grads(lambda *t: attention.attention_reference(*t, **kw), q, k, v)
    assert_close(run_with_grads(lambda *t: attention.attention_cudnn(*t, **kw), q, k, v), want, torch.float32,
                 f"cudnn {variant}")
    compiled = torch.compile(attention.attention_cudnn, backend="aot_eager", fullgraph=True)
    assert_close(run_with_grads(lambda *t: compiled(*t, **kw), q, k, v), want, torch.float32,
                 f"compiled cudnn {variant}")


@needs_hopper
@pytest.mark.parametrize("shape", [(2, 8, 2, 256, 64), (1, 4, 4, 128, 128)], ids=["gqa", "mha"])
def test_cudnn_attention_runs_cudnn_and_matches_reference_on_hopper(shape):
    b, hq, hkv, s, d = shape
    q, k, v = rand(b, hq, s, d, seed=1), rand(b, hkv, s, d, seed=2), rand(b, hkv, s, d, seed=3)
    want = run_with_grads(attention.attention_reference, q, k, v)
    low = [t.detach().cuda().bfloat16().requires_grad_() for t in (q, k, v)]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        got = run_with_grads(lambda *t: attention.causal_attention(*t, backend="auto"), *low)
    assert_close([g.cpu() for g in got], want, torch.bfloat16, "cudnn attention")
    ops = {event.name for event in prof.events()}
    assert "aten::_scaled_dot_product_cudnn_attention" in ops, sorted(o for o in ops if "attention" in o)


# ---- norm, rope, swiglu ----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(3, 16), (2, 5, 64)])
def test_rms_norm_torch_backend_matches_reference(dtype, shape):
    x, w = rand(*shape, seed=1), rand(shape[-1], seed=2)
    want = run_with_grads(lambda a, b: norm.rms_norm_reference(a, b, 1e-5), x, w)
    low = [t.detach().to(dtype).requires_grad_() for t in (x, w)]
    got = run_with_grads(lambda a, b: norm.rms_norm(a, b, 1e-5, backend="auto"), *low)
    assert_close(got, want, dtype, "rms_norm")


@needs_apex
def test_apex_rms_norm_matches_reference_on_cuda():
    x, w = rand(4, 7, 256, seed=1), rand(256, seed=2)
    want = run_with_grads(lambda a, b: norm.rms_norm_reference(a, b, 1e-5), x, w)
    low = [t.detach().cuda().to(torch.bfloat16).requires_grad_() for t in (x, w)]
    got = run_with_grads(lambda a, b: norm.rms_norm(a, b, 1e-5, backend="apex"), *low)
    assert_close([g.cpu() for g in got], want, torch.bfloat16, "apex rms_norm")


def test_norm_backend_selection():
    x = torch.randn(2, 8)
    assert norm.select_backend("auto", x) == "torch" and norm.select_backend("torch", x) == "torch"
    with pytest.raises(RuntimeError, match="norm_backend=apex needs"):
        norm.select_backend("apex", x)
    with pytest.raises(ValueError, match="not one of"):
        norm.select_backend("triton", x)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(2, 4, 8, 16), (1, 2, 5, 64)])
def test_fused_rope_matches_reference(dtype, shape):
    cos, sin = rope.rope_cos_sin(shape[2], shape[3], 10000.0, dtype=dtype)
    x = rand(*shape, seed=1)
    want = run_with_grads(lambda t: rope.apply_rope(t, *rope.rope_cos_sin(shape[2], shape[3], 10000.0)), x)
    got = run_with_grads(lambda t: rope.apply_rope_fused(t, cos, sin), x.detach().to(dtype).requires_grad_())
    assert_close(got, want, dtype, "rope")


def test_fused_rope_on_transposed_input_with_per_token_angles_and_mixed_dtypes():
    """The layouts the model passes (q as a transposed view, per-token cos/sin [b, 1, s, d] for packed
    documents) and a bf16 input with fp32 tables, which promotes to fp32 as the reference does."""
    cos, sin = rope.rope_cos_sin(12, 16, 10000.0)
    positions = torch.randint(0, 12, (2, 12), generator=torch.Generator().manual_seed(3))
    per_token = [table[positions].unsqueeze(1) for table in (cos, sin)]
    q = rand(2, 12, 4, 16, seed=4).transpose(1, 2)  # [b, heads, s, d], not contiguous
    want = run_with_grads(lambda t: rope.apply_rope(t, *per_token), q.detach().requires_grad_())
    got = run_with_grads(lambda t: rope.apply_rope_fused(t, *per_token), q.detach().requires_grad_())
    assert_close(got, want, torch.float32, "rope, per-token angles")
    low = q.detach().to(torch.bfloat16).requires_grad_()
    out = rope.apply_rope_fused(low, cos, sin)
    assert out.dtype == rope.apply_rope(low, cos, sin).dtype == torch.float32
    out.sum().backward()
    assert low.grad.dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(3, 32), (2, 7, 48)])
def test_swiglu_matches_reference(dtype, shape):
    gate, up = rand(*shape, seed=1) * 3, rand(*shape, seed=2)
    gate = gate.detach().requires_grad_()
    want = run_with_grads(swiglu.swiglu_reference, gate, up)
    low = [t.detach().to(dtype).requires_grad_() for t in (gate, up)]
    assert_close(run_with_grads(swiglu.swiglu, *low), want, dtype, "swiglu")


# ---- cross-entropy ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("chunk", [0, 1, 5, 64])
@pytest.mark.parametrize("shape", [(2, 9, 37), (13, 200)])
def test_chunked_cross_entropy_matches_torch(dtype, chunk, shape):
    logits = (rand(*shape, seed=1) * 4).detach().requires_grad_()
    labels = torch.randint(0, shape[-1], shape[:-1], generator=torch.Generator().manual_seed(2))
    want = run_with_grads(lambda t: cross_entropy.cross_entropy_reference(t, labels), logits)
    low = logits.detach().to(dtype).requires_grad_()
    got = run_with_grads(lambda t: cross_entropy.cross_entropy(t, labels, chunk_tokens=chunk), low)
    assert got[0].shape == labels.shape
    assert_close(got, want, dtype, f"cross_entropy chunk={chunk}")


def test_cross_entropy_ignores_vocabulary_padding_and_keeps_logits_intact():
    logits = rand(6, 10, seed=3)
    labels = torch.randint(0, 7, (6,), generator=torch.Generator().manual_seed(4))
    before = logits.detach().clone()
    got = run_with_grads(lambda t: cross_entropy.cross_entropy(t, labels, chunk_tokens=4, vocab_size=7), logits)
    assert torch.equal(logits.detach(), before)
    want = run_with_grads(lambda t: cross_entropy.cross_entropy_reference(t[:, :7], labels), logits)
    assert_close(got, want, torch.float32, "padded cross_entropy")
    assert got[1][:, 7:].abs().max() == 0  # no gradient reaches the padding columns


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("chunk", [0, 1, 5, 64])
@pytest.mark.parametrize("vocab", [37, 30], ids=["full", "padded"])
def test_linear_cross_entropy_matches_linear_then_torch(dtype, chunk, vocab):
    """Output layer + loss fused: loss, hidden and weight gradients as F.linear + F.cross_entropy; weight rows
    at or beyond `vocab` are padding (no loss, no gradient)."""
    hidden, weight = rand(2, 9, 16, seed=1), rand(37, 16, seed=2)
    labels = torch.randint(0, vocab, (2, 9), generator=torch.Generator().manual_seed(3))
    want = run_with_grads(lambda h, w: cross_entropy.cross_entropy_reference(h @ w[:vocab].t(), labels), hidden, weight)
    low = [t.detach().to(dtype).requires_grad_() for t in (hidden, weight)]
    got = run_with_grads(lambda h, w: cross_entropy.linear_cross_entropy(h, w, labels, chunk_tokens=chunk,
                                                                        vocab_size=vocab), *low)
    assert got[0].shape == labels.shape
    assert_close(got, want, dtype, f"linear_cross_entropy chunk={chunk} vocab={vocab}")
    assert got[2][vocab:].abs().sum() == 0  # no gradient reaches the padding rows


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.skipif(
    not CUDA, reason="inductor's CPU backend needs a C++ toolchain and minutes per graph; GPUs run it"))])
@pytest.mark.parametrize("chunk", [0, 5])
def test_compiled_chunk_kernels_match_torch(backend, chunk):
    """train.compile's cross-entropy: the per-chunk kernels through torch.compile, with vocabulary padding
    (30 of 37 columns real), chunked and unchunked, unfused and fused with the output layer."""
    device = "cuda" if backend == "inductor" else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    hidden, weight = rand(2, 9, 16, seed=1), rand(37, 16, seed=2)
    labels = torch.randint(0, 30, (2, 9), generator=torch.Generator().manual_seed(3))
    want = run_with_grads(lambda h, w: cross_entropy.cross_entropy_reference(h @ w[:30].t(), labels), hidden, weight)
    low = [t.detach().to(device, dtype).requires_grad_() for t in (hidden, weight)]
    on = labels.to(device)
    unfused = run_with_grads(lambda h, w: cross_entropy.cross_entropy(h @ w.t(), on, chunk, vocab_size=30,
                                                                      compile_backend=backend), *low)
    fused = run_with_grads(lambda h, w: cross_entropy.linear_cross_entropy(h, w, on, chunk, vocab_size=30,
                                                                           compile_backend=backend), *low)
    for got, what in ((unfused, "compiled cross_entropy"), (fused, "compiled linear_cross_entropy")):
        assert_close([g.cpu() for g in got], want, dtype, f"{what} chunk={chunk}")
        assert got[2][30:].abs().sum() == 0
    assert backend in cross_entropy._compiled  # the compiled kernels ran, not the eager ones


# ---- AdamW -----------------------------------------------------------------------------------------------

def _adamw_run(implementation):
    params = [torch.nn.Parameter(torch.randn(5, 3, generator=torch.Generator().manual_seed(i))) for i in range(3)]
    opt = adamw.adamw([{"params": params[:2], "weight_decay": 0.1}, {"params": params[2:], "weight_decay": 0.0}],
                      1e-2, (0.9, 0.95), 1e-8, implementation)
    for step in range(4):
        for i, p in enumerate(params):
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(100 * step + i))
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in params])


def test_adamw_implementations_agree_with_the_plain_loop():
    plain = _adamw_run("foreach")
    params = [torch.nn.Parameter(torch.randn(5, 3, generator=torch.Generator().manual_seed(i))) for i in range(3)]
    loop = torch.optim.AdamW([{"params": params[:2], "weight_decay": 0.1}, {"params": params[2:], "weight_decay": 0.0}],
                             lr=1e-2, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    for step in range(4):
        for i, p in enumerate(params):
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(100 * step + i))
        loop.step()
    want = torch.cat([p.detach().reshape(-1) for p in params])
    torch.testing.assert_close(plain, want, rtol=0, atol=1e-6, check_dtype=False)
    torch.testing.assert_close(_adamw_run("fused"), want, rtol=0, atol=1e-6, check_dtype=False)


def test_adamw_selection():
    assert adamw.select_implementation("auto", on_cuda=False) == "fused"
    assert adamw.select_implementation("auto", on_cuda=True) == "fused"
    with pytest.raises(RuntimeError, match="implementation=apex needs"):
        adamw.select_implementation("apex", on_cuda=False)
    with pytest.raises(ValueError, match="not one of"):
        adamw.select_implementation("lamb", on_cuda=False)


@pytest.mark.skipif(not (CUDA and adamw._ApexFusedAdam is not None), reason="apex FusedAdam needs CUDA and apex")
def test_apex_fused_adam_matches_torch_on_cuda():
    def run(implementation):
        p = torch.nn.Parameter(torch.randn(64, generator=torch.Generator().manual_seed(0)).cuda())
        opt = adamw.adamw([{"params": [p], "weight_decay": 0.1}], 1e-2, (0.9, 0.95), 1e-8, implementation)
        for step in range(4):
            p.grad = torch.randn(64, generator=torch.Generator().manual_seed(step)).cuda()
            opt.step()
        return p.detach().cpu()
    torch.testing.assert_close(run("apex"), run("fused"), rtol=0, atol=1e-6, check_dtype=False)
