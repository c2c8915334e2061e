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
        out = F.silu(gate.float()) * up.float()
        # no `.to` when it would be a no-op: torch 2.11's compiled autograd.Function drops the input
        # gradients when the output is such an alias (fp32 blocks got zero MLP gradients)
        return out if out.dtype == gate.dtype else out.to(gate.dtype)

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        g, dy = gate.float(), grad.float()
        # aten's fused silu_backward gives d silu/dg = s + g s (1 - s) times its first argument in one pass;
        # both results are written over a temporary of their own (two allocations, not four)
        d_gate = dy * up.float()
        torch.ops.aten.silu_backward.grad_input(d_gate, g, grad_input=d_gate)
        return d_gate.to(gate.dtype), F.silu(g).mul_(dy).to(up.dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return _SwiGLU.apply(gate, up)
