"""Operators on the meta device at the cost of a dictionary look-up.

On the meta device an operator's result is its shape, strides and dtype, and those follow from its inputs'
shapes, strides and dtypes and its other arguments alone. torch answers them with Python meta functions for
many operators (about a millisecond per elementwise call) behind a dispatch that costs tens of microseconds
more, and a training step asks the same questions again for every layer and micro-batch. `FastMeta` asks
once: the first answer to (operator, every input's shape, strides, dtype and offset, every other argument) is
kept, and the next identical call gets a fresh tensor of the kept shape and strides, or, for an in-place or
out= operator, the tensor it writes. Only aten operators are kept whose inputs are all meta tensors (or 0-dim
scalars); views, operators that change their input's shape, and anything whose result is not a fresh meta
tensor or its written input go to torch each time (so do the fake process group's c10d collectives).
A first call of a common elementwise operator is answered by its shape arithmetic (`FAST`): the broadcast
shape, torch's type promotion, the first input's layout where the shape is its own; an in-place one returns
its input; anything it does not cover goes to torch's own kernel, which also raises torch's errors.
tests/test_dry_run.py holds the records of dry runs under it against real gloo runs.
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


_SKIP = {torch.Tag.inplace_view, torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output}
_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.memory_format, torch.layout)


def _describe(values, key: list, tensors: list) -> bool:
    """Appends `values` (args, kwargs' values) to `key` (a tensor as is_meta, shape, strides, dtype, offset; a
    list as its type and length, then its items; a plain value as its type and itself) and their tensors to
    `tensors`; False if one is neither a meta tensor, a 0-dim scalar tensor nor a plain hashable value."""
    for v in values:
        if isinstance(v, torch.Tensor):
            meta = v.is_meta
            if not meta and v.dim():
                return False
            key += (meta, v.shape, v.stride(), v.dtype, v.storage_offset())
            tensors.append(v)
        elif isinstance(v, (list, tuple)):
            key += (list, len(v))
            if not _describe(v, key, tensors):
                return False
        elif isinstance(v, _PLAIN):
            key += (type(v), v)
        else:
            return False
    return True


def _signature(func, args, kwargs):
    """The cache key of a call and its tensors, or (None, None) where the call is not one to keep."""
    key, tensors = [id(func), torch.get_default_dtype(), len(args)], []
    if not _describe(args, key, tensors):
        return None, None
    if kwargs:
        key.append(tuple(kwargs))
        if not _describe(kwargs.values(), key, tensors):
            return None, None
    return tuple(key), tensors


def _keepable(func) -> bool:
    """aten operators whose every result is a fresh tensor or (in place, out=) an input it writes."""
    if func.namespace != "aten" or _SKIP.intersection(func.tags):
        return False
    returns = func._schema.returns
    return bool(returns) and (all(r.alias_info is None for r in returns) or
                              all(r.alias_info is not None and r.alias_info.is_write for r in returns))


def _answer(out, before: list, tensors: list):
    """What to keep of a result: ("new", (shape, strides, dtype)) or ("input", position) per tensor, and
    whether it was one tensor; None if a result is neither, or an input it wrote changed shape (resized)."""
    single = isinstance(out, torch.Tensor)
    results = [out] if single else out
    if not isinstance(results, (list, tuple)) or not all(isinstance(t, torch.Tensor) for t in results):
        return None
    kept = []
    for t in results:
        position = next((i for i, v in enumerate(tensors) if v is t), None)
        if position is not None:
            if before[position] != (t.shape, t.stride()):
                return None
            kept.append(("input", position))
        elif t.is_meta and t.storage_offset() == 0 and t.untyped_storage().nbytes() == \
                torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta").untyped_storage().nbytes():
            kept.append(("new", (t.shape, t.stride(), t.dtype)))
        else:
            return None
    return kept, single


def _replay(answer, tensors):
    kept, single = answer
    out = [tensors[how] if kind == "input" else torch.empty_strided(how[0], how[1], dtype=how[2], device="meta")
           for kind, how in kept]
    return out[0] if single else tuple(out)


class FastMeta(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.kept: dict = {}
        self.keepable: dict = {}  # id(operator) -> _keepable (an OpOverload's own hash is Python, and slow)

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # nothing is compiled in a dry run: no torch._dynamo guard around every dispatch

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        keep = self.keepable.get(id(func))
        if keep is None:
            keep = self.keepable[id(func)] = _keepable(func)
        key = tensors = None
        if keep:
            key, tensors = _signature(func, args, kwargs)
            answer = self.kept.get(key) if key is not None else None
            if answer is not None:
                return _replay(answer, tensors)
            before = [(t.shape, t.stride()) for t in tensors or ()]
        out = NotImplemented
        fast = FAST.get(func)
        if fast is not None:
            out = fast(*args, **kwargs)
        if out is NotImplemented:
            out = func(*args, **kwargs)
        if key is not None:
            answer = _answer(out, before, tensors)
            if answer is not None:
                self.kept[key] = answer
        return out
