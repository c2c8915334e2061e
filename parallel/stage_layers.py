"""Which transformer layers each pipeline stage (and each of its virtual chunks) holds.

The model is cut into n = p·v consecutive chunks of layers. Chunk c lives on pipeline rank c mod p as
that rank's virtual chunk c div p (Megatron's interleaved assignment): with p=2, v=2 rank 0 holds chunks
0 and 2, rank 1 holds chunks 1 and 3. Without interleaving (v=1) chunk c is simply stage c. The V placement
of parallel.schedule=zbv instead puts chunks c and 2p − 1 − c on rank c: with p=2 rank 0 holds 0 and 3. The first
chunk also holds the embedding, the last the final norm and LM head; with tied embeddings the last stage
keeps its own copy of the embedding as `lm_head` whose gradient is summed with the first stage's.
"""
from __future__ import annotations

import torch

from parallel import comm


def chunk_layer_counts(num_layers: int, num_chunks: int, explicit: list[int] | None = None) -> list[int]:
    """Layers per chunk: `explicit` as given (validated), else as even as possible, earlier chunks taking
    the remainder one layer each."""
    if explicit:
        if len(explicit) != num_chunks or sum(explicit) != num_layers or min(explicit) < 1:
            raise ValueError(f"parallel.stage_layers={list(explicit)} must have parallel.pipeline × virtual_stages "
                             f"= {num_chunks} entries, each at least 1, summing to model.num_layers={num_layers}")
        return list(explicit)
    if num_layers < num_chunks:
        raise ValueError(f"model.num_layers={num_layers} cannot fill {num_chunks} pipeline chunks")
    base, extra = divmod(num_layers, num_chunks)
    return [base + (1 if c < extra else 0) for c in range(num_chunks)]


def balanced_layer_counts(num_layers: int, num_chunks: int, first_extra: float = 0.0,
                          last_extra: float = 0.0) -> list[int]:
    """Layers per chunk that make the costliest chunk as cheap as possible, costs in units of one layer: the
    first chunk also carries `first_extra` (embedding), the last `last_extra` (final norm, output layer, loss).
    Each chunk gets one layer, then each further layer goes to the cheapest chunk so far (the earliest on a
    tie): optimal for equal layers, and with no extras the same as the even split."""
    if num_layers < num_chunks:
        raise ValueError(f"model.num_layers={num_layers} cannot fill {num_chunks} pipeline chunks")
    counts = [1] * num_chunks
    extra = [0.0] * num_chunks
    extra[0] += first_extra
    extra[-1] += last_extra
    for _ in range(num_layers - num_chunks):
        cheapest = min(range(num_chunks), key=lambda c: (counts[c] + extra[c], c))
        counts[cheapest] += 1
    return counts


def model_chunk(pp_rank: int, pipeline: int, chunk: int, v_shape: bool = False) -> int:
    """The model chunk (in model order) that virtual chunk `chunk` of `pp_rank` holds: c·p + rank
    (interleaved), or under the V placement (parallel.schedule=zbv, two chunks per rank) rank, then
    2p − 1 − rank, so that rank 0 holds the first and the last chunk."""
    if v_shape:
        return pp_rank if chunk == 0 else 2 * pipeline - 1 - pp_rank
    return chunk * pipeline + pp_rank


def balanced_v_layer_counts(num_layers: int, pipeline: int, first_extra: float = 0.0,
                            last_extra: float = 0.0) -> list[int]:
    """Layers per model chunk (model order, 2p chunks) under the V placement, costs in units of one layer:
    rank r holds chunks r and 2p − 1 − r, so rank 0 carries both `first_extra` and `last_extra`. First each
    rank's total, making the costliest rank as cheap as possible (two layers each, then every further layer
    to the cheapest rank, the earliest on a tie); then each rank's two chunks as even in cost as its total
    allows (the earlier chunk taking a remainder)."""
    if num_layers < 2 * pipeline:
        raise ValueError(f"model.num_layers={num_layers} cannot fill {2 * pipeline} pipeline chunks")
    totals = [2] * pipeline
    extra = [first_extra + last_extra] + [0.0] * (pipeline - 1)
    for _ in range(num_layers - 2 * pipeline):
        cheapest = min(range(pipeline), key=lambda r: (totals[r] + extra[r], r))
        totals[cheapest] += 1
    counts = [0] * (2 * pipeline)
    for rank, total in enumerate(totals):
        early, late = (first_extra, last_extra) if rank == 0 else (0.0, 0.0)
        k = min(range(1, total), key=lambda k: (max(k + early, total - k + late), -k))
        counts[rank], counts[2 * pipeline - 1 - rank] = k, total - k
    return counts


def stage_layer_ids(num_layers: int, pipeline: int, virtual: int = 1,
                    explicit: list[int] | None = None, v_shape: bool = False) -> list[list[list[int]]]:
    """layer_ids[pp_rank][virtual_chunk] = the global layer indices of that chunk."""
    counts = chunk_layer_counts(num_layers, pipeline * virtual, explicit)
    starts = [sum(counts[:c]) for c in range(len(counts))]
    index = [[model_chunk(r, pipeline, j, v_shape) for j in range(virtual)] for r in range(pipeline)]
    return [[list(range(starts[c], starts[c] + counts[c])) for c in row] for row in index]


def chunk_roles(pp_rank: int, pipeline: int, virtual: int, chunk: int, v_shape: bool = False) -> tuple[bool, bool]:
    """(pre_process, post_process): embedding on the very first chunk, LM head on the very last."""
    index = model_chunk(pp_rank, pipeline, chunk, v_shape)
    return index == 0, index == pipeline * virtual - 1


def tied_embedding_weights(chunks) -> list[torch.nn.Parameter]:
    """This rank's copies of the tied embedding: the first chunk's input table and/or the last chunk's head."""
    out = []
    for chunk in chunks:
        if not chunk.cfg.tie_embeddings:
            continue
        if chunk.pre_process and chunk.model.embed_tokens is not None:
            out.append(chunk.model.embed_tokens.weight)
        if chunk.lm_head is not None and getattr(chunk.lm_head.weight, "pipeline_duplicate", False):
            out.append(chunk.lm_head.weight)
    return out



def sum_tied_gradients(grads: list, group) -> None:
    """Sum the tied embedding's gradient over its copies (`grads`: this rank's copies' gradients): over
    `group` (the first and last stage) when each holds one, or here when this rank holds both (rank 0 of the
    V placement); then every copy holds the sum."""
    if len(grads) == 2:
        grads[0].add_(grads[1])
        grads[1].copy_(grads[0])
        return
    for grad in grads:
        comm.all_reduce(grad, group)
