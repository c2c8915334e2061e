"""Causal self-attention core: flash-attn on CUDA when installed, PyTorch SDPA with cuDNN's kernel first
on Hopper, else PyTorch SDPA (torch's own kernel order), else a reference.

All take q [b, hq, s, d] and k, v [b, hkv, s, d] (grouped-query when hkv < hq) and return [b, hq, s, d].
Optional extras, honoured by every backend:
  - `slopes` [h] (ALiBi): flash-attn applies them itself; the other backends build the additive bias from
    them unless `bias` [h, s, s] is given;
  - `window` > 0: sliding window, each query sees itself and the `window - 1` tokens before it;
  - `segment_ids` [b, s]: document ids of packed sequences; a query never sees another document
    (flash-attn runs its varlen kernel on the documents, the others mask).
GQA never repeats K/V in memory on the flash and SDPA paths; only the reference repeats them.

Why `cudnn`: SDPA tries its built-in FlashAttention-2 first, but on Hopper (sm90) cuDNN's fused attention
is faster for training shapes; `cudnn` is SDPA with cuDNN moved to the front of the priority order (a
preference: shapes cuDNN cannot serve fall back to torch's order, so it is always correct).
"""
import math
import weakref

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

try:  # GPU-only optional dependency
    from flash_attn import flash_attn_func as _flash_attn_func
    from flash_attn import flash_attn_varlen_func as _flash_attn_varlen_func
except ImportError:
    _flash_attn_func = _flash_attn_varlen_func = None

BACKENDS = ("auto", "flash", "cudnn", "sdpa", "reference")
CUDNN_FIRST = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
               SDPBackend.MATH]


def flash_available() -> bool:
    return _flash_attn_func is not None and torch.cuda.is_available()


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


def allowed_mask(seq_length: int, device, window: int = 0, segment_ids=None) -> torch.Tensor:
    """Boolean [b or 1, 1, s, s]: True where query i may attend key j (causal, window, same document)."""
    pos = torch.arange(seq_length, device=device)
    return position_mask(pos, pos, window, segment_ids, segment_ids)


def attention_reference(q, k, v, bias=None, dropout_p: float = 0.0, window: int = 0, segment_ids=None):
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if bias is not None:
        scores = scores + bias.to(scores.dtype)
    allowed = allowed_mask(q.shape[2], q.device, window, segment_ids)
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    probs = F.dropout(probs, p=dropout_p) if dropout_p > 0 else probs
    return probs @ v


def attention_sdpa(q, k, v, bias=None, dropout_p: float = 0.0, window: int = 0, segment_ids=None):
    gqa = k.shape[1] != q.shape[1]
    if bias is None and window == 0 and segment_ids is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p, enable_gqa=gqa)
    mask = allowed_mask(q.shape[2], q.device, window, segment_ids)
    if bias is not None:  # additive float mask: the bias where allowed, -inf elsewhere
        mask = bias.to(q.dtype).masked_fill(~mask, float("-inf"))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, enable_gqa=gqa)


def attention_cudnn(q, k, v, bias=None, dropout_p: float = 0.0, window: int = 0, segment_ids=None):
    """SDPA with cuDNN's kernel preferred (torch.compile traces the context manager)."""
    with sdpa_kernel(CUDNN_FIRST, set_priority=True):
        return attention_sdpa(q, k, v, bias, dropout_p, window, segment_ids)


def is_hopper(t: torch.Tensor) -> bool:
    # get_device_properties, not get_device_capability: torch.compile folds it to a constant
    return t.is_cuda and torch.cuda.get_device_properties(t.device).major == 9


_cu_seqlens_cache: list = [None, -1, None]  # (weak reference to segment_ids, its version, result)
_host_offsets: dict = {}  # id(segment_ids) -> (cu, longest), computed on the host before the copy


def flash_varlen_in_use() -> bool:
    """Whether packed documents go to flash-attn's varlen kernel, which wants their offsets."""
    return _flash_attn_varlen_func is not None


def remember_offsets(segment_ids: torch.Tensor, host_segment_ids: torch.Tensor) -> None:
    """Compute the document offsets of `segment_ids` from its host copy, before the device has it: the varlen
    kernel then needs no device-to-host read of the longest document. Forgotten with the tensor."""
    cu, longest = _compute_cu_seqlens(host_segment_ids)
    key = id(segment_ids)
    _host_offsets[key] = (cu.to(segment_ids.device, non_blocking=True), longest)
    weakref.finalize(segment_ids, _host_offsets.pop, key, None)


def _cu_seqlens(segment_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Start offsets (int32, with the total at the end) of the documents of the flattened [b*s] batch, and
    the longest document: remembered from the host copy (`remember_offsets`), else computed once per tensor
    (every layer sees the same segment_ids), since on a device the longest length costs a host sync."""
    if id(segment_ids) in _host_offsets:
        return _host_offsets[id(segment_ids)]
    ref, version, result = _cu_seqlens_cache
    if ref is not None and ref() is segment_ids and version == segment_ids._version:
        return result
    result = _compute_cu_seqlens(segment_ids)
    _cu_seqlens_cache[:] = [weakref.ref(segment_ids), segment_ids._version, result]
    return result


def _compute_cu_seqlens(segment_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    b, s = segment_ids.shape
    starts = torch.ones_like(segment_ids, dtype=torch.bool)
    starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    offsets = starts.reshape(-1).nonzero().squeeze(-1)
    total = torch.tensor([b * s], device=offsets.device, dtype=offsets.dtype)
    cu = torch.cat((offsets, total)).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max().item())


def attention_flash(q, k, v, dropout_p: float = 0.0, slopes=None, window: int = 0, segment_ids=None):
    # flash-attn wants [b, s, h, d] and handles GQA natively (no repeated KV in memory).
    window_size = (window - 1, 0) if window > 0 else (-1, -1)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if segment_ids is None:
        out = _flash_attn_func(q, k, v, dropout_p=dropout_p, causal=True, window_size=window_size,
                               alibi_slopes=slopes)
        return out.transpose(1, 2)
    b, s = segment_ids.shape
    cu, longest = _cu_seqlens(segment_ids)
    flat = [t.reshape(b * s, t.shape[2], t.shape[3]) for t in (q, k, v)]
    out = _flash_attn_varlen_func(*flat, cu, cu, longest, longest, dropout_p=dropout_p, causal=True,
                                  window_size=window_size, alibi_slopes=slopes)
    return out.view(b, s, out.shape[1], out.shape[2]).transpose(1, 2)


@torch.no_grad()
def attention_entropy(q, k, bias=None, window: int = 0, segment_ids=None, slopes=None,
                      allowed=None) -> tuple[float, int]:
    """(sum over batch, heads and queries of the attention distribution's entropy in nats, number of
    distributions), with the masks of `causal_attention`, or the boolean `allowed` [b or 1, 1, sq, sk] of
    `position_mask` when given (queries and keys of other lengths, e.g. context parallelism's). One head at a
    time: a monitoring probe must not need the [b, h, sq, sk] scores at once."""
    groups = q.shape[1] // k.shape[1]
    if bias is None and slopes is not None:
        bias = alibi_bias(slopes.float(), q.shape[2], q.device)
    if allowed is None:
        allowed = allowed_mask(q.shape[2], q.device, window, segment_ids)
    allowed = allowed[:, 0]
    total = 0.0
    for h in range(q.shape[1]):
        scores = (q[:, h].float() @ k[:, h // groups].float().transpose(-2, -1)) / math.sqrt(q.shape[-1])
        if bias is not None:
            scores = scores + bias[h].float()
        log_probs = torch.log_softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        total += -(log_probs.exp() * log_probs.masked_fill(~allowed, 0.0)).sum().item()
    return total, q.shape[0] * q.shape[1] * q.shape[2]


def select_backend(requested: str, q: torch.Tensor, plain: bool = True) -> str:
    """The backend that will run for `q`: an explicit request is honoured or refused, `auto` picks.
    `plain`: causal attention with no documents, window or ALiBi (where cuDNN's kernel is measured best)."""
    if requested not in BACKENDS:
        raise ValueError(f"attention backend {requested!r} is not one of {BACKENDS}; "
                         f"set model.attention_backend to one of them")
    low_precision = q.dtype in (torch.float16, torch.bfloat16)
    if requested == "flash":
        if _flash_attn_func is None:
            raise RuntimeError("model.attention_backend=flash needs flash-attn (pip install -e .[gpu] on a CUDA "
                               "machine); use model.attention_backend=auto to fall back to SDPA")
        if not q.is_cuda or not low_precision:
            raise RuntimeError(f"model.attention_backend=flash needs CUDA tensors in bf16/fp16, got "
                               f"{q.device.type} {q.dtype}; use train.precision=bf16 on a GPU or "
                               f"model.attention_backend=auto")
    if requested == "cudnn" and not (q.is_cuda and low_precision):
        raise RuntimeError(f"model.attention_backend=cudnn needs CUDA tensors in bf16/fp16, got {q.device.type} "
                           f"{q.dtype}; use train.precision=bf16 on a GPU or model.attention_backend=auto")
    if requested != "auto":
        return requested
    if not (q.is_cuda and low_precision):
        return "sdpa"
    if plain and is_hopper(q):
        return "cudnn"
    return "flash" if _flash_attn_func is not None else "sdpa"


def causal_attention(q, k, v, bias=None, dropout_p: float = 0.0, backend: str = "auto", slopes=None,
                     window: int = 0, segment_ids=None):
    """Causal attention through the chosen backend; see the module docstring for the arguments."""
    chosen = select_backend(backend, q, plain=bias is None and slopes is None and window == 0 and segment_ids is None)
    if chosen == "flash":  # flash-attn applies ALiBi from the slopes itself and wants them in fp32
        return attention_flash(q, k, v, dropout_p, None if slopes is None else slopes.float(), window, segment_ids)
    if bias is None and slopes is not None:  # built only here: [h, s, s] is large and flash never needs it
        bias = alibi_bias(slopes, q.shape[2], q.device)
    if chosen == "sdpa":
        return attention_sdpa(q, k, v, bias, dropout_p, window, segment_ids)
    if chosen == "cudnn":
        return attention_cudnn(q, k, v, bias, dropout_p, window, segment_ids)
    return attention_reference(q, k, v, bias, dropout_p, window, segment_ids)


def position_mask(q_positions, k_positions, window: int = 0, q_segments=None, k_segments=None) -> torch.Tensor:
    """Boolean [b or 1, 1, sq, sk]: True where a query at sequence index q_positions[i] may attend the key at
    k_positions[j] (causal, sliding window, same document). Positions are the tokens' indices in the full
    sequence, whatever order the tensors hold them in (context parallelism holds them out of order)."""
    distance = q_positions[:, None] - k_positions[None, :]
    allowed = distance >= 0
    if window > 0:
        allowed = allowed & (distance < window)
    allowed = allowed[None, None]
    if q_segments is not None:
        allowed = allowed & (q_segments[:, None, :, None] == k_segments[:, None, None, :])
    return allowed


def position_bias(slopes: torch.Tensor, q_positions, k_positions) -> torch.Tensor:
    """ALiBi's additive bias [h, sq, sk] for queries and keys at these sequence indices: −slope · distance
    (fp32; `position_mask` hides the keys ahead)."""
    distance = (q_positions[:, None] - k_positions[None, :]).clamp(min=0).float()
    return -slopes.float()[:, None, None] * distance
