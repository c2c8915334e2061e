"""Elementwise kernels on the meta device at the cost of their shape arithmetic.

torch registers Python meta functions for the elementwise operators (over the C++ ones): about a millisecond
per call, which made up most of a simulated training step (a 7B rank issues tens of thousands). Under
`FastMeta` the commonest ones, when every tensor is on the meta device (or a 0-dim scalar), are answered
directly: the broadcast shape, torch's type promotion, the first input's layout where the shape is its own;
an in-place one returns its input. Anything else (another operator, a shape that does not broadcast, a real
tensor) goes to torch's own kernel, which also raises torch's errors. tests/test_dry_run.py holds the records of
dry runs under it against real gloo runs.
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten


def _operands(args) -> list | None:
    """The tensor operands if every one is on the meta device or a 0-dim scalar tensor, else None."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if not tensors or any(t.device.type != "meta" and t.dim() for t in tensors):
        return None
    return tensors


def _result(args, dtype=None):
    tensors = _operands(args)
    if tensors is None:
        return NotImplemented
    try:
        shape = torch.broadcast_shapes(*(t.shape for t in tensors))
    except RuntimeError:
        return NotImplemented
    if dtype is None:
        values = [a for a in args if isinstance(a, (torch.Tensor, int, float, bool))]
        dtype = values[0] if len(values) == 1 else torch.result_type(values[0], values[1])
        dtype = dtype.dtype if isinstance(dtype, torch.Tensor) else dtype
    for t in tensors:
        if t.shape == shape and t.device.type == "meta":
            return torch.empty_like(t, dtype=dtype)
    return torch.empty(shape, dtype=dtype, device="meta")


def _binary(a, b, *rest, **kwargs):
    return _result((a, b))


def _true_divide(a, b, *rest, rounding_mode=None, **kwargs):
    out = _result((a, b))
    if out is NotImplemented or rounding_mode is not None or out.dtype.is_floating_point:
        return out if rounding_mode is None else NotImplemented
    return torch.empty_like(out, dtype=torch.get_default_dtype())


def _where(condition, a, b):
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return NotImplemented
    out = _result((a, b))
    if out is NotImplemented or _operands((condition,)) is None:
        return NotImplemented
    shape = torch.broadcast_shapes(condition.shape, out.shape)
    return out if shape == out.shape else torch.empty(shape, dtype=out.dtype, device="meta")


def _in_place(self, *operands, **kwargs):
    tensors = _operands((self, *operands))
    if tensors is None or self.device.type != "meta":
        return NotImplemented
    try:
        if torch.broadcast_shapes(*(t.shape for t in tensors)) != self.shape:
            return NotImplemented
    except RuntimeError:
        return NotImplemented
    return self


def _reduced(self, dim=None, keepdim=False, dtype=None, integral_to_long=True):
    if _operands((self,)) is None:
        return NotImplemented
    dims = range(self.dim()) if dim is None or dim == [] else [d % max(self.dim(), 1) for d in
                                                                 (dim if isinstance(dim, (list, tuple)) else [dim])]
    shape = [1 if i in dims else n for i, n in enumerate(self.shape)] if keepdim else \
        [n for i, n in enumerate(self.shape) if i not in dims]
    if dtype is None:
        dtype = self.dtype if self.dtype.is_floating_point or not integral_to_long else torch.int64
    return torch.empty(shape, dtype=dtype, device="meta")


def _sum(self, dim=None, keepdim=False, *, dtype=None):
    return _reduced(self, dim, keepdim, dtype)


def _mean(self, dim=None, keepdim=False, *, dtype=None):
    return _reduced(self, dim, keepdim, dtype, integral_to_long=False)


def _like_first(self, *rest, dtype=None, **kwargs):
    """An operator whose result has its first input's shape (softmax, tril)."""
    if _operands((self,)) is None:
        return NotImplemented
    return torch.empty_like(self, dtype=dtype if isinstance(dtype, torch.dtype) else None)


def _softmax_backward(grad, output, dim, input_dtype):
    return NotImplemented if _operands((grad, output)) is None else torch.empty_like(grad, dtype=input_dtype)


def _into(*args, out=None, grad_input=None, **kwargs):
    """An out= variant of a shape-preserving operator: its output buffer, when every shape broadcasts to it."""
    target = out if out is not None else grad_input
    if target is None:
        return NotImplemented
    return _in_place(target, *[a for a in args if isinstance(a, torch.Tensor)])


def _addmm_(self, mat1, mat2, **kwargs):
    if _operands((self, mat1, mat2)) is None or mat1.dim() != 2 or mat2.dim() != 2 or \
            (mat1.shape[0], mat2.shape[1]) != tuple(self.shape) or mat1.shape[1] != mat2.shape[0]:
        return NotImplemented
    return self


FAST = {aten.add.Tensor: _binary, aten.sub.Tensor: _binary, aten.mul.Tensor: _binary,
        aten.add.Scalar: _binary, aten.sub.Scalar: _binary, aten.mul.Scalar: _binary,
        aten.div.Tensor: _true_divide, aten.div.Scalar: _true_divide, aten.where.self: _where,
        aten.pow.Tensor_Scalar: _binary, aten.maximum.default: _binary, aten.minimum.default: _binary,
        aten.remainder.Scalar: _binary, aten.sum.dim_IntList: _sum, aten.mean.dim: _mean,
        aten._safe_softmax.default: _like_first, aten.tril.default: _like_first,
        aten._softmax_backward_data.default: _softmax_backward, aten.mul.out: _into,
        aten.silu_backward.grad_input: _into, aten.addmm_.default: _addmm_}
FAST.update({op: _in_place for op in (aten.add_.Tensor, aten.sub_.Tensor, aten.mul_.Tensor, aten.div_.Tensor,
                                      aten.add_.Scalar, aten.mul_.Scalar, aten.div_.Scalar, aten.addcmul_.default,
                                      aten.addcdiv_.default, aten.lerp_.Scalar, aten.copy_.default)})


class FastMeta(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        fast = FAST.get(func)
        if fast is not None:
            out = fast(*args, **kwargs)
            if out is not NotImplemented:
                return out
        return func(*args, **kwargs)
