"""MixedPrecisionAdamW: same numbers as torch AdamW, clipping, fp32 masters, fp16 overflow skipping."""
import math

import torch

from engine.config.schema import OptimConfig
from engine.optim.replicated import MixedPrecisionAdamW
from parallel.topology import single_process


def _params(dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    w = torch.nn.Parameter(torch.randn(8, 4, generator=gen).to(dtype))
    norm = torch.nn.Parameter(torch.ones(4, dtype=dtype))
    return [("layer.weight", w), ("layer.input_layernorm.weight", norm)]


def _grads(params, scale=1.0):
    gen = torch.Generator().manual_seed(1)
    for _, p in params:
        p.grad = (torch.randn(p.shape, generator=gen) * scale).to(p.dtype)


def test_fp32_step_equals_torch_adamw_with_decay_groups_and_clipping():
    cfg = OptimConfig(lr=0.1, weight_decay=0.1, clip_grad=0.5)
    ours = _params()
    ref = [(n, torch.nn.Parameter(p.detach().clone())) for n, p in ours]
    opt = MixedPrecisionAdamW(ours, cfg, single_process(), "fp32")
    ref_opt = torch.optim.AdamW([{"params": [ref[0][1]], "weight_decay": 0.1}, {"params": [ref[1][1]],
                                "weight_decay": 0.0}], lr=0.1, betas=(0.9, 0.95), eps=1e-8)
    for _ in range(3):
        _grads(ours)
        _grads(ref)
        norm, skipped = opt.step(0.1)
        expected_norm = torch.nn.utils.clip_grad_norm_([p for _, p in ref], 0.5).item()
        ref_opt.step()
        assert not skipped and math.isclose(norm, expected_norm, rel_tol=1e-6)
    for (_, a), (_, b) in zip(ours, ref):
        assert torch.allclose(a, b, atol=1e-6)


def test_bf16_parameters_keep_fp32_masters():
    params = _params(torch.bfloat16)
    opt = MixedPrecisionAdamW(params, OptimConfig(lr=1e-3, clip_grad=0), single_process(), "bf16")
    assert all(m.dtype == torch.float32 for m in opt.master)
    before = opt.master[0].detach().clone()
    _grads(params)
    opt.step(1e-3)
    moved = opt.master[0] - before
    assert moved.abs().max() > 0 and moved.abs().max() < 2e-3   # tiny updates survive in fp32
    assert torch.equal(params[0][1], opt.master[0].to(torch.bfloat16))


def test_fp16_overflow_skips_step_and_halves_scale():
    params = _params(torch.float16)
    opt = MixedPrecisionAdamW(params, OptimConfig(lr=1e-3), single_process(), "fp16")
    scale = opt.scaler.scale
    before = [p.detach().clone() for _, p in params]
    _grads(params)
    params[0][1].grad[0, 0] = float("inf")
    norm, skipped = opt.step(1e-3)
    assert skipped and not math.isfinite(norm) and opt.scaler.scale == scale / 2
    assert all(torch.equal(b, p) for b, (_, p) in zip(before, params))
    opt.zero_grad()
    _grads(params, scale=opt.scaler.scale * 1e-3)   # small gradients of a scaled loss
    norm, skipped = opt.step(1e-3)
    assert not skipped and math.isfinite(norm)


def test_owned_state_reload_continues_exactly_with_state_where_torch_keeps_it():
    """load_owned_state (checkpoint resume, HF load) goes through torch's load_state_dict, so each state tensor
    lands where the implementation keeps it (fused: `step` on the parameter's device), and the run continues
    bit for bit."""
    for implementation in ("fused", "foreach"):
        cfg = OptimConfig(lr=0.1, weight_decay=0.1, clip_grad=0.5, implementation=implementation)
        ran, resumed = _params(), _params()
        opt = MixedPrecisionAdamW(ran, cfg, single_process(), "fp32")
        for _ in range(2):
            _grads(ran)
            opt.step(0.1)
        saved = {name: {key: t.clone() if torch.is_tensor(t) else t for key, t in entry.items()}
                 for name, entry in opt.owned_state().items()}
        again = MixedPrecisionAdamW(resumed, cfg, single_process(), "fp32")
        again.adam_step = opt.adam_step
        again.load_owned_state(lambda name, key, start, end: saved[name][key][start:end])
        for m, n in zip(opt.master, again.master):
            for key, value in opt.inner.state[m].items():
                assert again.inner.state[n][key].device == value.device, (implementation, key)
        for optimizer, params in ((opt, ran), (again, resumed)):
            _grads(params)
            optimizer.step(0.1)
        for (_, a), (_, b) in zip(ran, resumed):
            assert torch.equal(a, b), implementation


def test_state_away_from_its_parameter_is_named():
    params = _params()
    opt = MixedPrecisionAdamW(params, OptimConfig(lr=0.1), single_process(), "fp32")
    _grads(params)
    opt.step(0.1)
    opt.check_state_devices()
    opt.inner.state[opt.master[0]]["exp_avg"] = torch.empty(opt.master[0].shape, device="meta")
    try:
        opt.check_state_devices()
    except RuntimeError as exc:
        assert "exp_avg of layer.weight is on meta" in str(exc)
    else:
        raise AssertionError("a moment on another device was not named")
