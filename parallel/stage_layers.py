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


def fill_cheapest(num_layers: int, extra: list[float], least: int = 1) -> list[int]:
    """Layers per slot (a chunk, or a rank) that make the costliest slot as cheap as possible, costs in units of
    one layer, slot i also carrying extra[i]: `least` layers each, then each further layer to the cheapest slot
    so far (the earliest on a tie). Optimal because every layer costs the same; with no extras the even split."""
    counts = [least] * len(extra)
    for _ in range(num_layers - least * len(extra)):
        cheapest = min(range(len(extra)), key=lambda i: (counts[i] + extra[i], i))
        counts[cheapest] += 1
    return counts


def balanced_layer_counts(num_layers: int, pipeline: int, first_extra: float = 0.0, last_extra: float = 0.0,
                          virtual: int = 1, v_shape: bool = False) -> list[int]:
    """Layers per model chunk (model order, p·v chunks), costs in units of one layer: the first chunk also
    carries `first_extra` (embedding), the last `last_extra` (final norm, output layer, loss). A rank runs
    every one of its chunks for each micro-batch, so the costliest rank sets the pipeline's steady pace: the
    ranks' totals are evened out first (`fill_cheapest` over ranks, v layers each to start), then each rank's
    chunks, the earlier taking a remainder. Under the V placement (`v_shape`) rank 0 holds both ends and so
    both extras; interleaved, the last rank holds the last chunk beside v − 1 others."""
    chunks = pipeline * virtual
    if num_layers < chunks:
        raise ValueError(f"model.num_layers={num_layers} cannot fill {chunks} pipeline chunks")
    chunk_extra = [first_extra * (c == 0) + last_extra * (c == chunks - 1) for c in range(chunks)]
    ranks = [[model_chunk(r, pipeline, j, v_shape) for j in range(virtual)] for r in range(pipeline)]
    totals = fill_cheapest(num_layers, [sum(chunk_extra[c] for c in held) for held in ranks], least=virtual)
    counts = [0] * chunks
    for held, total in zip(ranks, totals):
        for c, n in zip(held, fill_cheapest(total, [chunk_extra[c] for c in held])):
            counts[c] = n
    return counts


def model_chunk(pp_rank: int, pipeline: int, chunk: int, v_shape: bool = False) -> int:
    """The model chunk (in model order) that virtual chunk `chunk` of `pp_rank` holds: c·p + rank
    (interleaved), or under the V placement (parallel.schedule=zbv, two chunks per rank) rank, then
    2p − 1 − rank, so that rank 0 holds the first and the last chunk."""
    if v_shape:
        return pp_rank if chunk == 0 else 2 * pipeline - 1 - pp_rank
    return chunk * pipeline + pp_rank


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
