"""The AdamW kernel behind engine/optim/replicated.py: torch's fused (one CUDA kernel for all tensors) or foreach
(multi-tensor) implementation, or apex's FusedAdam in AdamW mode. All compute the same update
(decoupled weight decay, bias-corrected moments, eps added to the bias-corrected sqrt(v)).

`auto` takes torch's fused kernel, on CUDA and on CPU (measured 3× faster than foreach on CPU): on current
GPUs it is as fast as apex's and keeps the optimizer state in torch's own format (checkpoints stay
portable between implementations); apex is used when asked for (optim.implementation=apex).
"""
from __future__ import annotations

import torch

try:  # GPU-only optional dependency
    from apex.optimizers import FusedAdam as _ApexFusedAdam
except ImportError:
    _ApexFusedAdam = None

IMPLEMENTATIONS = ("auto", "apex", "fused", "foreach")


def select_implementation(requested: str, on_cuda: bool, on_meta: bool = False) -> str:
    """The implementation to run; on the meta device (a dry run) foreach, the one with meta kernels, whose
    state has the fused kernel's shapes and dtypes."""
    if requested not in IMPLEMENTATIONS:
        raise ValueError(f"AdamW implementation {requested!r} is not one of {IMPLEMENTATIONS}; "
                         f"set optim.implementation to one of them")
    if requested == "apex" and (_ApexFusedAdam is None or not on_cuda):
        raise RuntimeError("optim.implementation=apex needs NVIDIA apex (built with --cuda_ext) and CUDA "
                           "parameters; use optim.implementation=auto")
    if requested in ("auto", "fused"):
        return "foreach" if on_meta else "fused"
    return requested


def adamw(param_groups: list, lr: float, betas: tuple, eps: float, implementation: str = "auto"):
    """A torch.optim.Optimizer over `param_groups` (each with its own weight_decay)."""
    on_cuda = all(p.is_cuda for g in param_groups for p in g["params"])
    chosen = select_implementation(implementation, on_cuda, any(p.is_meta for g in param_groups for p in g["params"]))
    if chosen == "apex":
        return _ApexFusedAdam(param_groups, lr=lr, betas=betas, eps=eps, adam_w_mode=True, weight_decay=0.0)
    return torch.optim.AdamW(param_groups, lr=lr, betas=betas, eps=eps, fused=chosen == "fused",
                             foreach=chosen == "foreach")
