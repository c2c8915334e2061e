"""Causal self-attention core: flash-attn on CUDA when installed, else PyTorch SDPA, else a reference.

All take q [b, hq, s, d] and k, v [b, hkv, s, d] (grouped-query when hkv < hq) and return [b, hq, s, d].
"""
import math

import torch
import torch.nn.functional as F

try:  # GPU-only optional dependency
    from flash_attn import flash_attn_func as _flash_attn_func
except ImportError:
    _flash_attn_func = None

BACKENDS = ("auto", "flash", "sdpa", "reference")


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """Geometric head slopes of ALiBi (Press et al.), extended for head counts that are not powers of 2."""
    def power_of_two_slopes(n):
        start = 2 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]
    closest = 2 ** math.floor(math.log2(num_heads))
    slopes = power_of_two_slopes(closest)
    if closest < num_heads:
        slopes += power_of_two_slopes(2 * closest)[0::2][: num_heads - closest]
    return torch.tensor(slopes, dtype=torch.float32)


def alibi_bias(slopes: torch.Tensor, seq_length: int, device=None) -> torch.Tensor:
    """Causal ALiBi bias [heads, s, s]: -slope * distance below the diagonal, -inf above."""
    pos = torch.arange(seq_length, device=device)
    distance = (pos[:, None] - pos[None, :]).float()
    bias = -slopes.to(device)[:, None, None] * distance
    return bias.masked_fill(distance < 0, float("-inf"))


def attention_reference(q, k, v, bias=None, dropout_p: float = 0.0):
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    s = q.shape[2]
    if bias is None:
        causal = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(causal, float("-inf"))
    else:
        scores = scores + bias.to(scores.dtype)
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    probs = F.dropout(probs, p=dropout_p) if dropout_p > 0 else probs
    return probs @ v


def attention_sdpa(q, k, v, bias=None, dropout_p: float = 0.0):
    gqa = k.shape[1] != q.shape[1]
    if bias is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias.to(q.dtype), dropout_p=dropout_p,
                                          enable_gqa=gqa)


def attention_flash(q, k, v, bias=None, dropout_p: float = 0.0, slopes=None):
    # flash-attn wants [b, s, h, d] and handles GQA natively (no repeated KV in memory).
    out = _flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dropout_p=dropout_p,
                           causal=True, alibi_slopes=slopes)
    return out.transpose(1, 2)


def select_backend(requested: str, q: torch.Tensor) -> str:
    if requested not in BACKENDS:
        raise ValueError(f"attention backend {requested!r} is not one of {BACKENDS}")
    if requested == "flash" and (_flash_attn_func is None or not q.is_cuda):
        raise RuntimeError("attention backend 'flash' needs flash-attn installed and CUDA tensors; "
                           "use 'auto' or install the gpu extra (pip install -e .[gpu])")
    if requested != "auto":
        return requested
    if _flash_attn_func is not None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        return "flash"
    return "sdpa"


def causal_attention(q, k, v, bias=None, dropout_p: float = 0.0, backend: str = "auto", slopes=None):
    """bias: optional additive [h, s, s] (ALiBi); `slopes` is the same information for flash-attn."""
    chosen = select_backend(backend, q)
    if chosen == "flash":
        return attention_flash(q, k, v, dropout_p=dropout_p, slopes=slopes)
    if chosen == "sdpa":
        return attention_sdpa(q, k, v, bias, dropout_p)
    return attention_reference(q, k, v, bias, dropout_p)
