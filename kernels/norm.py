"""RMSNorm: apex's fused kernel when installed on CUDA, else the PyTorch reference."""
import torch

try:  # GPU-only optional dependency
    from apex.normalization.fused_layer_norm import fused_rms_norm_affine as _apex_rms_norm
except ImportError:
    _apex_rms_norm = None


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Statistics in fp32 whatever the input dtype, as Hugging Face Llama does.
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, backend: str = "auto") -> torch.Tensor:
    if backend == "apex" or (backend == "auto" and _apex_rms_norm is not None and x.is_cuda):
        if _apex_rms_norm is None:
            raise RuntimeError("norm backend 'apex' requested but apex is not installed; see README (apex)")
        return _apex_rms_norm(x, weight, weight.shape, eps)
    return rms_norm_reference(x, weight, eps)
