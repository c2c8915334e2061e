"""How many transformer layers each pipeline chunk holds: `parallel.stage_layers` when given, else by
`parallel.stage_balance`.

`layers` (default) splits the layer count evenly. `compute` evens out estimated training FLOPs per
token instead, first over ranks, then over each rank's chunks (`balanced_layer_counts`), counting the last
chunk's output layer: 6·h·V for the output matmul against 6·(a layer's parameters) + 12·h·s for a layer
(engine/observe/metrics.flops_per_token's terms). The first chunk's embedding is a lookup (forward a gather,
backward a scatter-add: h operations a token against a layer's millions) and counts as nothing, although the
6N of flops_per_token counts its parameters as a matmul's. With a large vocabulary the output layer is worth
several layers (hidden 256, vocabulary 8192, sequence 256: 2.3; hidden 2048, vocabulary 131072, sequence 2048:
4.5), and the even split leaves the last stage the bottleneck of every pipeline step. Interleaved, the last rank
holds the output layer beside its other chunks; under the V placement (parallel.schedule=zbv) rank 0 holds the
first and the last chunk. Earlier stages then hold more layers, and under 1F1B they also keep more
micro-batches' activations: `memory_estimate` shows what that costs per stage.
"""
from __future__ import annotations

import functools

from engine.config.schema import Config
from engine.model import layer_parameters
from parallel.stage_layers import balanced_layer_counts, chunk_layer_counts


def output_layer_cost(cfg: Config) -> float:
    """The output layer's training FLOPs per token, in transformer layers."""
    m = cfg.model
    layer = 6 * layer_parameters(m) + 12 * m.hidden_size * m.seq_length
    return 6 * m.hidden_size * m.vocab_size / layer


def chunk_layers(cfg: Config) -> list[int]:
    """Layers per pipeline chunk, in chunk order (pipeline × virtual_stages entries)."""
    p = cfg.parallel
    chunks = p.pipeline * p.virtual_stages
    if p.stage_layers:
        return chunk_layer_counts(cfg.model.num_layers, chunks, p.stage_layers)
    if p.stage_balance == "compute":
        return list(compute_balanced(cfg.model.num_layers, p.pipeline, p.virtual_stages, p.schedule == "zbv",
                                     output_layer_cost(cfg)))
    return chunk_layer_counts(cfg.model.num_layers, chunks)


@functools.lru_cache(maxsize=1024)  # the planner asks for every stage of thousands of layouts
def compute_balanced(num_layers: int, pipeline: int, virtual: int, v_shape: bool, last_extra: float) -> tuple:
    return tuple(balanced_layer_counts(num_layers, pipeline, last_extra=last_extra, virtual=virtual, v_shape=v_shape))
