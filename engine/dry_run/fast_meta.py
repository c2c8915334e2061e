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


FAST = {aten.add.Tensor: _binary, aten.sub.Tensor: _binary, aten.mul.Tensor: _binary,
        aten.add.Scalar: _binary, aten.sub.Scalar: _binary, aten.mul.Scalar: _binary,
        aten.div.Tensor: _true_divide, aten.div.Scalar: _true_divide, aten.where.self: _where,
        aten.pow.Tensor_Scalar: _binary, aten.maximum.default: _binary, aten.minimum.default: _binary}
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
