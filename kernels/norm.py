"""RMSNorm: apex's fused CUDA kernel when installed, else the PyTorch reference.

apex's entry point is `apex.normalization.fused_layer_norm.fused_rms_norm_affine(input, weight,
normalized_shape, eps)` (the function behind its `FusedRMSNorm` module); it computes the statistics in
fp32 and returns the input dtype, as the reference does.
"""
import torch

try:  # GPU-only optional dependency
    from apex.normalization.fused_layer_norm import fused_rms_norm_affine as _apex_rms_norm
except ImportError:
    _apex_rms_norm = None

BACKENDS = ("auto", "apex", "torch")


def apex_available() -> bool:
    return _apex_rms_norm is not None and torch.cuda.is_available()


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Statistics in fp32 whatever the input dtype, as Hugging Face Llama does.
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def select_backend(requested: str, x: torch.Tensor) -> str:
    if requested not in BACKENDS:
        raise ValueError(f"norm backend {requested!r} is not one of {BACKENDS}; set model.norm_backend to one")
    if requested == "apex":
        if _apex_rms_norm is None:
            raise RuntimeError("model.norm_backend=apex needs NVIDIA apex built with --cuda_ext (see README, "
                               "apex); use model.norm_backend=auto to fall back to PyTorch")
        if not x.is_cuda:
            raise RuntimeError(f"model.norm_backend=apex needs CUDA tensors, got {x.device.type}; "
                               "use model.norm_backend=auto")
        return "apex"
    if requested == "auto" and _apex_rms_norm is not None and x.is_cuda:
        return "apex"
    return "torch"


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, backend: str = "auto") -> torch.Tensor:
    if select_backend(backend, x) == "apex":
        return _apex_rms_norm(x, weight, weight.shape, eps)
    return rms_norm_reference(x, weight, eps)
