"""Which parameter gets which optimizer, weight decay and place in the gradient norm: the rules, stated once.

Under `optim.name=muon` the 2-D weights of the transformer blocks are Muon's: q, k, v, o and gate, up, down,
each one matrix (the model stores q, k and v apart, so each is orthogonalised on its own, as torch.optim.Muon
would see them). Everything else is AdamW's: the embedding and output tables, the norms, any biases.
"""
from __future__ import annotations

import re

import torch

# the blocks' projection weights, by their Hugging Face names (engine/model.py: model.layers.<i>.<this>)
MUON_MATRIX = re.compile(r"(^|\.)layers\.(\d+\.)?(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight$")


def uses_muon(name: str, param: torch.nn.Parameter, optimizer: str) -> bool:
    """Whether `name` is stepped by Muon under `optim.name=optimizer`."""
    shape = getattr(param, "full_shape", param.shape)  # a ZeRO-3 parameter's own storage may be released
    return optimizer == "muon" and len(shape) == 2 and muon_matrix(name)


def muon_matrix(name: str) -> bool:
    """Whether `name` is one of the blocks' projection weights (engine/memory_estimate.py asks by name, without
    the layer index)."""
    return MUON_MATRIX.search(name) is not None


def no_weight_decay(name: str, param: torch.nn.Parameter) -> bool:
    """AdamW's exemptions: 1-D parameters (biases, norms) and norm weights."""
    return param.dim() < 2 or "norm" in name


def counts_in_norm(param: torch.nn.Parameter, tp_rank: int) -> bool:
    """Replicated parameters are counted on TP rank 0 only; a tied output copy is never counted twice."""
    if getattr(param, "pipeline_duplicate", False):
        return False
    return getattr(param, "tp_dim", None) is not None or tp_rank == 0
