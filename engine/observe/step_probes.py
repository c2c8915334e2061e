"""The training-health readings of engine/observe/monitor.py taken around one step, for the step's record.

Before the optimizer consumes the gradients: the per-head gradient sums of the noise probe. After the step:
the gradient-norm alarm, tracing of non-finite losses to their samples, memory, the head-gradient variance
ratios and, on probe steps, the attention entropy of a no-gradient forward of the step's first micro-batch.
"""
from __future__ import annotations

import torch

from engine.evaluate.validation import forward_only
from engine.observe.monitor import TrainingMonitor
from parallel import comm
from parallel.distributed import world_group


class StepProbes:
    def __init__(self, monitor: TrainingMonitor, chunks: list, num_layers: int, tp_rank: int, device: torch.device,
                 to_micro_batch):
        self.monitor, self.chunks, self.num_layers = monitor, chunks, num_layers
        self.tp_rank, self.device, self.to_micro_batch = tp_rank, device, to_micro_batch
        self.head_sums = None

    def gradients(self, step: int, data_parallel) -> None:
        """Before step `step`'s optimizer update: the head-gradient sums, on probe steps (summed over every rank)."""
        self.head_sums = None
        if self.monitor.probe_due(step):
            self.head_sums = self.monitor.head_gradient_sums(data_parallel.owned_gradients(), self.tp_rank,
                                                             self.device)
            comm.all_reduce(self.head_sums, world_group())

    def readings(self, step: int, record: dict, losses_by_rank: torch.Tensor, window_start: int,
                 micro_batch_size: int, describe_sample, first_tokens: torch.Tensor, pipe) -> dict:
        """The readings after step `step` (record: its loss and grad_norm), to add to the record."""
        out = {}
        if self.monitor.grad_norm_alarm(step, record["grad_norm"]):
            out["grad_norm_alarm"] = True
        bad = self.monitor.nonfinite(step, losses_by_rank, record["grad_norm"], window_start, micro_batch_size,
                                     describe_sample)
        if bad:
            out["nonfinite_samples"] = bad
        out.update(self.monitor.memory(step, self.device))
        if self.monitor.probe_due(step):
            sums = self.attention_entropy_sums(first_tokens, pipe)
            out["attention_entropy"] = self.monitor.attention_entropy(step, sums)
        if self.head_sums is not None:
            out["head_grad_variance_ratio"] = self.monitor.head_variance_ratios(step, self.head_sums)
        return out

    def attention_entropy_sums(self, tokens: torch.Tensor, pipe) -> torch.Tensor:
        """[2, num_layers]: attention entropy sums and counts of a no-gradient forward of `tokens`, summed over
        every rank (heads over TP, layers over PP, samples over DP)."""
        for chunk in self.chunks:
            chunk.eval()
            chunk.capture_attention_entropy(True)
        forward_only(self.chunks, [self.to_micro_batch(tokens)], pipe)
        sums = torch.zeros(2, self.num_layers, dtype=torch.float64, device=self.device)
        for chunk in self.chunks:
            for layer, (entropy, count) in chunk.attention_entropy_sums().items():
                sums[0, layer], sums[1, layer] = entropy, count
            chunk.capture_attention_entropy(False)
        comm.all_reduce(sums, world_group())
        return sums
