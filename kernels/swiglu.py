"""SwiGLU activation silu(gate) * up as one autograd node.

Plain autograd keeps silu(gate) as an extra activation for backward; this keeps only gate and up and
recomputes sigmoid(gate) in backward, computing in fp32 and rounding once for low-precision inputs.
"""
import torch
import torch.nn.functional as F


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        g = gate.float()
        out = g * torch.sigmoid(g) * up.float()
        # no `.to` when it would be a no-op: torch 2.11's compiled autograd.Function drops the input
        # gradients when the output is such an alias (fp32 blocks got zero MLP gradients)
        return out if out.dtype == gate.dtype else out.to(gate.dtype)

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        g, u, dy = gate.float(), up.float(), grad.float()
        s = torch.sigmoid(g)
        silu = g * s
        d_gate = dy * u * s * (1 + g * (1 - s))  # d silu/dg = s + g s (1 - s)
        return d_gate.to(gate.dtype), (dy * silu).to(up.dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return _SwiGLU.apply(gate, up)
