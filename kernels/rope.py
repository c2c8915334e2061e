"""Rotary position embedding in the rotate-half convention of Hugging Face Llama.

`apply_rope` is the reference (plain autograd). `apply_rope_fused` is one autograd node: it saves nothing
but cos/sin (shared by every layer) and its backward is the inverse rotation, so no rotated copy of q or
k is kept for backward; under `train.compile` the elementwise body fuses into one kernel.
"""
import torch


def rope_cos_sin(seq_length: int, head_dim: int, theta: float, device=None, dtype=torch.float32):
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))
    positions = torch.arange(seq_length, device=device, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq)
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def _rotate_half_transposed(x: torch.Tensor) -> torch.Tensor:
    # The adjoint of _rotate_half: (a, b) -> (b, -a).
    first, second = x.chunk(2, dim=-1)
    return torch.cat((second, -first), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [batch, heads, seq, head_dim]; cos/sin: [seq, head_dim]."""
    return x * cos + _rotate_half(x) * sin


class _RoPE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return x * cos + _rotate_half(x) * sin

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        return grad * cos + _rotate_half_transposed(grad * sin), None, None


def apply_rope_fused(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Same result as `apply_rope`; cos/sin are constants (no gradient flows to them)."""
    return _RoPE.apply(x, cos.detach(), sin.detach())
