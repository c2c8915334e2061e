"""Per-step metrics: one JSON object per line in metrics.jsonl and a readable console line."""
from __future__ import annotations

import json
import resource
import time
from pathlib import Path

import torch

H100_BF16_PEAK_FLOPS = 989e12
DATA_WAIT_SHOWN = 0.05  # the console line names the loader once it holds training back this much


def flops_per_token(num_params: int, num_layers: int, hidden_size: int, seq_length: int) -> float:
    """Training FLOPs per token: 6N for the matmuls plus 12·L·H·Q·T (= 12·L·h·T) for attention."""
    return 6 * num_params + 12 * num_layers * hidden_size * seq_length


def peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # kB → GiB (Linux)


class MetricsLog:
    def __init__(self, run_dir: Path, enabled: bool, console=print, trackers=None):
        self.enabled, self.console = enabled, console
        self.trackers = trackers  # engine/trackers.Trackers: TensorBoard / W&B get every record written here
        self.path = Path(run_dir) / "metrics.jsonl"
        self.file = open(self.path, "a", buffering=1) if enabled else None
        self.last_time = time.perf_counter()

    def elapsed(self) -> float:
        now = time.perf_counter()
        dt, self.last_time = now - self.last_time, now
        return dt

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps(record) + "\n")
        if self.trackers:
            self.trackers.log(record)
        parts = [f"step {record['step']:>6}", f"loss {record['loss']:.4f}", f"lr {record['lr']:.3e}",
                 f"grad_norm {record['grad_norm']:.3f}", f"{record['tokens_per_s']:,.0f} tok/s"]
        if "eval_loss" in record:
            parts.append(f"eval loss {record['eval_loss']:.4f} (ppl {record['eval_ppl']:.1f})")
        if record.get("eval_loss_by_dataset"):
            parts.append("eval loss by dataset " + ", ".join(
                f"{name} {loss:.4f}" for name, loss in record["eval_loss_by_dataset"].items()))
        if "attention_entropy" in record:
            entropy = record["attention_entropy"]
            parts.append(f"attention entropy {min(entropy):.2f}–{max(entropy):.2f} nats")
        if record.get("mfu") is not None:
            parts.append(f"MFU {100 * record['mfu']:.1f}%")
        data_share = record.get("data_wait_s", 0.0) / max(record.get("step_time_s", 0.0), 1e-9)
        if data_share >= DATA_WAIT_SHOWN:
            parts.append(f"data wait {100 * data_share:.0f}% of the step")
        if record.get("skipped"):
            parts.append("SKIPPED (overflow)")
        self.console(" | ".join(parts))

    def event(self, record: dict) -> None:
        """A record that is not a step's (no loss, no console line), e.g. where the checkpoints' copies are."""
        if self.enabled:
            self.file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        if self.file:
            self.file.close()
        if self.trackers:
            self.trackers.close()
