"""Predicted step time of a layout, from a device profile (engine/plan/profile.py) and the collectives of
engine/plan/volumes.py.

Per micro-batch, each pipeline stage computes its layers and, on the last stage, the output layer and loss:
forward and backward times from the profile at this layout's FLOPs per call (tokens T = micro batch ×
sequence / CP, widths / TP; on a CPU, scaled by how many ranks share its cores against the calibration's).
Full recomputation adds a layer forward to its backward, selective recomputation
the attention core's share of it. Tensor-parallel, context-parallel and pipeline transfers sit on the critical
path of every micro-batch: they are counted as exposed. The slowest stage sets the pace: busy = m × its slot,
and the schedule's bubble (engine/plan/bubble.py) adds its idle share. Data-parallel gradient reduction
overlaps the backward it follows: a reduction hides behind one micro-batch's backward except the last unit's
(a ZeRO 0 bucket, else one block), so exposed = max(time − that backward, time of the last piece); ZeRO 3's
parameter gathers are prefetched the same way behind the forward and backward; the all-gather of updated
parameters after the optimizer step (ZeRO 1, 2) and HSDP's all-reduce across groups are exposed whole, and so
are the step's scalar reductions (the gradient norm over the model-parallel and shard groups, the loss over
data parallelism: one latency each). The optimizer step costs its fp32 master elements × the profile's time
per element.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.config.schema import Config, data_parallel_size
from engine.model import layer_parameters
from engine.plan import volumes
from engine.plan.bubble import bubble_time
from engine.plan.profile import DeviceProfile
from parallel.tensor import padded_vocab_size


@dataclass
class Prediction:
    compute: float  # seconds of forward and backward compute on the slowest stage
    exposed: dict = field(default_factory=dict)  # {group: seconds} of communication on the critical path
    overlapped: dict = field(default_factory=dict)  # {group: seconds} hidden behind compute
    bubble: float = 0.0
    optimizer: float = 0.0

    @property
    def total(self) -> float:
        return self.compute + sum(self.exposed.values()) + self.bubble + self.optimizer

    def summary(self) -> str:
        parts = [f"compute {self.compute:.3g}s"]
        parts += [f"{group} {seconds:.3g}s" for group, seconds in self.exposed.items() if seconds > 0]
        parts += [f"bubble {self.bubble:.3g}s"] if self.bubble else []
        parts.append(f"optimizer {self.optimizer:.3g}s")
        hidden = [f"{group} {seconds:.3g}s" for group, seconds in self.overlapped.items() if seconds > 0]
        return ", ".join(parts) + (f" (overlapped: {', '.join(hidden)})" if hidden else "")


def layer_flops(cfg: Config) -> tuple[float, float]:
    """(forward FLOPs of one layer call on one rank, of which the attention core)."""
    m, p = cfg.model, cfg.parallel
    tokens = volumes.tokens(cfg)
    attention = 4 * tokens * m.num_attention_heads * m.head_dim * m.seq_length / p.tensor
    return 2 * tokens * layer_parameters(m) / p.tensor + attention, attention


def head_flops(cfg: Config) -> float:
    m, t = cfg.model, cfg.parallel.tensor
    return 2 * volumes.tokens(cfg) * m.hidden_size * padded_vocab_size(m.vocab_size, t) / t


def stage_compute(cfg: Config, stage: int, profile: DeviceProfile, ranks_per_node: int) -> tuple[float, float, float]:
    """(forward, backward, recomputation) seconds of one micro-batch on `stage`."""
    flops, attention = layer_flops(cfg)
    fwd, bwd = profile.layer_time(flops, ranks_per_node)
    recompute = {"none": 0.0, "selective": fwd * attention / flops, "full": fwd}[cfg.train.recompute]
    chunks = volumes.stage_chunks(cfg, stage)
    layers = sum(n for n, _, _ in chunks)
    forward, backward = layers * fwd, layers * bwd
    if any(post for _, _, post in chunks):
        head_fwd, head_bwd = profile.head_time(head_flops(cfg), ranks_per_node)
        forward, backward = forward + head_fwd, backward + head_bwd
    return forward, backward, layers * recompute


def comm_time(collectives: list, profile: DeviceProfile) -> dict:
    """{group: seconds of all its calls}."""
    out: dict = {}
    for c in collectives:
        out[c.group] = out.get(c.group, 0.0) + c.count * profile.link(c.link).time(c.wire_bytes())
    return out


def predict(cfg: Config, world_size: int, profile: DeviceProfile, gpus_per_node: int) -> Prediction:
    p, t = cfg.parallel, cfg.train
    dp = data_parallel_size(cfg, world_size)
    micro_batches = t.global_batch_size // (t.micro_batch_size * dp)
    slots = []
    for stage in range(p.pipeline):
        forward, backward, recompute = stage_compute(cfg, stage, profile, min(world_size, gpus_per_node))
        comm = comm_time(volumes.per_micro_batch(cfg, stage, world_size, gpus_per_node), profile)
        slots.append((forward + backward + recompute + sum(comm.values()), stage, forward, backward + recompute,
                      comm))
    slot, stage, forward, backward, comm = max(slots, key=lambda s: s[0])
    pred = Prediction(compute=micro_batches * (forward + backward),
                      exposed={group: micro_batches * seconds for group, seconds in comm.items()})
    if p.pipeline > 1:
        pred.bubble = bubble_time(p.schedule, p.pipeline, micro_batches, p.virtual_stages, micro_batches * slot)
    exposed, hidden = data_parallel_time(cfg, stage, world_size, gpus_per_node, profile, forward, backward)
    pred.exposed["dp"], pred.overlapped["dp"] = exposed, hidden
    n = dp * p.context
    scalars = (p.tensor * p.pipeline > 1) + (n > 1) + (p.zero_stage > 0 and n > 1)  # norm and loss reductions
    pred.exposed["scalars"] = scalars * profile.link(volumes.link_of(world_size, gpus_per_node)).latency_s
    shard = (p.hsdp_group_size or n) if p.zero_stage else 1
    pred.optimizer = volumes.stage_parameters(cfg, stage) / shard * profile.optimizer_s_per_element * \
        profile.contention(min(world_size, gpus_per_node))
    return pred


def data_parallel_time(cfg: Config, stage: int, world_size: int, gpus_per_node: int, profile: DeviceProfile,
                       forward: float, backward: float) -> tuple[float, float]:
    """(exposed, overlapped) seconds of data parallelism's collectives in one step on `stage`."""
    p = cfg.parallel
    units = sum(n + pre + post for n, pre, post in volumes.stage_chunks(cfg, stage))  # blocks, embedding, head
    exposed = total = 0.0
    for c in volumes.per_step(cfg, stage, world_size, gpus_per_node):
        one = profile.link(c.link).time(c.wire_bytes())
        total += c.count * one
        if c.group == "dp-replicas" or (c.op == "all_gather" and p.zero_stage < 3):
            exposed += c.count * one
            continue
        last_piece = one * min(1.0, p.bucket_mb * 2**20 / max(c.nbytes, 1)) if p.zero_stage == 0 else one / units
        if c.op == "all_gather":  # ZeRO 3: half the gathers before forwards, half before backwards
            exposed += c.count / 2 * (max(one - forward, one / units) + max(one - backward, one / units))
        else:
            exposed += c.count * max(one - backward, last_piece)
    return exposed, total - exposed
