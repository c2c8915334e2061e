"""Training health beyond the loss curve.

  - gradient-norm alarm: a warning when the global norm exceeds `run.grad_norm_alarm` (default 2, twice the
    default clipping threshold);
  - non-finite losses traced to their samples: when a micro-batch's loss (or, outside fp16's loss
    scaling, the gradient norm) is NaN/Inf, the step is skipped and rank 0 writes
    `run.dir/nonfinite/step_00000012.json` (the step, 8 digits) naming the global sample indices, their
    token ids and, for real data, the dataset, document and source file:line of every piece
    (data.loader.sample_provenance);
    `run.max_nonfinite_steps` such steps in a row stop the run (it is not learning any more);
  - attention entropy per layer (every `run.monitor_interval` steps): a no-gradient probe forward of the
    step's first micro-batch, averaged over heads, queries, TP/PP/DP ranks, with a warning outside
    [`run.attention_entropy_min`, `run.attention_entropy_max`] (a fall toward 0 nats is attention entropy
    collapse: Zhai et al., 2023);
  - per-head gradient-variance ratio per layer (same interval): the variance of each query head's slice of
    the reduced q_proj gradient, max over min within the layer, with a warning above
    `run.head_grad_variance_alarm` (about 1 when heads learn evenly; the default 5 is a rule of thumb);
  - GPU memory fragmentation, 1 − peak allocated / peak reserved over the step: above
    `run.max_memory_fragmentation` the caching allocator's free blocks are released (`empty_cache`), at most
    once every RELEASE_INTERVAL steps, and that interval doubles after each release that freed less than
    RELEASE_HELPED of what was reserved (a step that needs the memory back would cudaMalloc it again).

Every rank runs the same checks (they share collectives); only rank 0 writes and warns.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from engine.config.schema import Config
from parallel.placement import compact_ranges

RELEASE_INTERVAL = 100  # steps between releases of cached blocks, at least
RELEASE_HELPED = 0.05  # a release that freed less than this fraction of the reserved memory did not help


class NonFiniteTraining(RuntimeError):
    """Too many consecutive steps with NaN/Inf: training is not progressing."""


class TrainingMonitor:
    def __init__(self, cfg: Config, run_dir: Path, rank: int, dp_size: int, console):
        self.cfg, self.run_dir, self.console = cfg, Path(run_dir), console
        self.is_reporter = rank == 0
        self.dp_size = dp_size
        self.nonfinite_streak = 0  # consecutive steps skipped for non-finite losses or gradients
        self.release_interval = RELEASE_INTERVAL  # doubled after a release that did not help
        self.next_release_step = 0  # the first step at which cached blocks may be released again

    # -- gradient norm ---------------------------------------------------------------------------------
    def grad_norm_alarm(self, step: int, grad_norm: float) -> bool:
        limit = self.cfg.run.grad_norm_alarm
        alarm = limit > 0 and math.isfinite(grad_norm) and grad_norm > limit
        if alarm and self.is_reporter:
            self.console(f"WARNING step {step}: grad_norm {grad_norm:.3f} above run.grad_norm_alarm={limit}")
        return alarm

    # -- non-finite losses -----------------------------------------------------------------------------
    def nonfinite(self, step: int, losses_by_rank: torch.Tensor, grad_norm: float, window_start: int,
                  micro_batch_size: int, describe) -> list[int]:
        """Global sample indices behind a non-finite step (empty if the step is sound). losses_by_rank:
        [dp, m] micro-batch losses; window_start: the step's first global sample; describe(i): a dict
        telling where sample i comes from (with its tokens)."""
        bad = (~torch.isfinite(losses_by_rank)).nonzero().tolist()
        norm_bad = not math.isfinite(grad_norm) and self.cfg.train.precision != "fp16"
        if not bad and not norm_bad:
            self.nonfinite_streak = 0
            return []
        self.nonfinite_streak += 1
        per_rank = losses_by_rank.shape[1] * micro_batch_size  # this step's share (the batch may ramp)
        if bad:  # the micro-batches whose loss is not finite
            why = "non-finite loss"
        else:  # finite losses, non-finite gradients: the whole batch is suspect
            bad = [(r, k) for r in range(self.dp_size) for k in range(per_rank // micro_batch_size)]
            why = "non-finite gradient norm with finite losses"
        groups = [(r, k, window_start + r * per_rank + k * micro_batch_size) for r, k in bad]
        samples = [i for _, _, first in groups for i in range(first, first + micro_batch_size)]
        if self.is_reporter:
            report = {"step": step, "reason": why, "grad_norm": str(grad_norm),
                      "micro_batches": [{"dp_rank": r, "micro_batch": k,
                                         "loss": str(losses_by_rank[r, k].item()),
                                         "samples": [describe(i) for i in range(first, first + micro_batch_size)]}
                                        for r, k, first in groups]}
            path = self.run_dir / "nonfinite" / f"step_{step:08d}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(report, indent=1, default=lambda v: v.item() if hasattr(v, "item") else
                                       str(v)))
            self.console(f"WARNING step {step}: {why} in samples {compact_ranges(samples, ', ')}; step skipped, "
                         f"details in {path}")
        limit = self.cfg.run.max_nonfinite_steps
        if limit and self.nonfinite_streak >= limit:  # every rank sees the same losses: all stop together
            raise NonFiniteTraining(f"{self.nonfinite_streak} consecutive steps (to step {step}) had non-finite "
                                    f"losses or gradients and were skipped; run.max_nonfinite_steps={limit}. The "
                                    f"samples are named in {self.run_dir / 'nonfinite'}; the weights are those of "
                                    f"the last good step: lower optim.lr or fix the data, then resume")
        return samples

    # -- attention entropy -----------------------------------------------------------------------------
    def probe_due(self, step: int) -> bool:
        """Whether step `step` takes the model-internal readings (attention entropy, head gradient variance)."""
        interval = self.cfg.run.monitor_interval
        return interval > 0 and step % interval == 0

    def attention_entropy(self, step: int, sums: torch.Tensor) -> list[float]:
        """sums: [2, num_layers] (entropy sums, counts) already summed over every rank."""
        per_layer = (sums[0] / sums[1].clamp(min=1)).tolist()
        low, high = self.cfg.run.attention_entropy_min, self.cfg.run.attention_entropy_max
        outside = [(i, e) for i, e in enumerate(per_layer) if (low > 0 and e < low) or (high > 0 and e > high)]
        if outside and self.is_reporter:
            layers = ", ".join(f"layer {i}: {e:.2f}" for i, e in outside)
            self.console(f"WARNING step {step}: attention entropy outside [{low}, {high}] nats: {layers}")
        return per_layer

    # -- per-head gradient variance -------------------------------------------------------------------
    def head_gradient_sums(self, owned, tp_rank: int, device) -> torch.Tensor:
        """[num_layers, heads, 3] float64 (count, sum, sum of squares) of each query head's q_proj gradient
        elements in `owned` (data_parallel.owned_gradients()); summed over every rank it covers each once."""
        m = self.cfg.model
        local_heads = m.num_attention_heads // self.cfg.parallel.tensor
        sums = torch.zeros(m.num_layers, m.num_attention_heads, 3, dtype=torch.float64, device=device)
        for name, _, start, grad in owned:
            parts = name.split(".")
            if not name.endswith("self_attn.q_proj.weight") or "layers" not in parts:
                continue
            layer = int(parts[parts.index("layers") + 1])
            index = torch.arange(start, start + grad.numel(), device=grad.device)
            head = tp_rank * local_heads + index // (m.head_dim * m.hidden_size)
            g = grad.detach().double()
            for k, values in enumerate((torch.ones_like(g), g, g * g)):
                sums[layer, :, k] += torch.bincount(head, weights=values, minlength=m.num_attention_heads)[
                    :m.num_attention_heads].to(device)
        return sums

    def head_variance_ratios(self, step: int, sums: torch.Tensor) -> list[float]:
        """Per layer: largest over smallest per-head gradient variance (sums already over every rank)."""
        count = sums[..., 0].clamp(min=1)
        variance = sums[..., 2] / count - (sums[..., 1] / count) ** 2
        ratios = (variance.max(dim=1).values / variance.min(dim=1).values.clamp(min=1e-300)).tolist()
        limit = self.cfg.run.head_grad_variance_alarm
        high = [(i, r) for i, r in enumerate(ratios) if limit > 0 and r > limit]
        if high and self.is_reporter:
            layers = ", ".join(f"layer {i}: {r:.1f}" for i, r in high)
            self.console(f"WARNING step {step}: per-head gradient variance ratio above "
                         f"run.head_grad_variance_alarm={limit}: {layers}")
        return ratios

    # -- memory ----------------------------------------------------------------------------------------
    def memory(self, step: int, device: torch.device) -> dict:
        """Peak allocated/reserved of the step on CUDA, releasing cached blocks when fragmentation is high."""
        if device.type != "cuda":
            return {}
        allocated, reserved = torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)
        fragmentation = 1.0 - allocated / reserved if reserved else 0.0
        out = {"memory_reserved_gb": reserved / 2**30, "memory_fragmentation": fragmentation}
        limit = self.cfg.run.max_memory_fragmentation
        if limit > 0 and fragmentation > limit and step >= self.next_release_step:
            out["memory_released_gb"] = self._release_cached_blocks(step, device, fragmentation, limit)
        torch.cuda.reset_peak_memory_stats(device)
        return out

    def _release_cached_blocks(self, step: int, device: torch.device, fragmentation: float, limit: float) -> float:
        """empty_cache(), then the next release no sooner than the interval allows; returns the GiB freed."""
        before = torch.cuda.memory_reserved(device)
        torch.cuda.empty_cache()
        after = torch.cuda.memory_reserved(device)
        helped = before - after >= RELEASE_HELPED * before
        self.release_interval = RELEASE_INTERVAL if helped else 2 * self.release_interval
        self.next_release_step = step + self.release_interval
        if self.is_reporter:
            self.console(f"WARNING step {step}: memory fragmentation {fragmentation:.2f} above "
                         f"run.max_memory_fragmentation={limit}; released the allocator's cached blocks: reserved "
                         f"{before / 2**30:.2f} -> {after / 2**30:.2f} GiB; next release at step "
                         f"{self.next_release_step} at the earliest")
        return (before - after) / 2**30
