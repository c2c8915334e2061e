"""parallel.stage_balance=compute (engine/stage_balance.py) against splits worked out by hand, for 1F1B, the
interleaved assignment and the V placement, with a 128k-vocabulary output layer worth several layers; and
the rank-first split against every split of small pipelines.

The shape: hidden h = 2048, 16 heads and 16 KV heads (q = kv = 2048), ffn f = 5632, sequence s = 2048,
vocabulary V = 131072. A layer's parameters: 2·h·q + 2·h·kv + 3·h·f + 2·h = 16 777 216 + 34 603 008 + 4 096
= 51 384 320; its training FLOPs per token 6·51 384 320 + 12·h·s = 308 305 920 + 50 331 648 = 358 637 568.
The output layer's 6·h·V = 1 610 612 736, so it costs 4.491 layers; the embedding (a lookup) costs nothing.
"""
import itertools

import pytest

from engine.config.schema import load_config
from engine.stage_balance import chunk_layers, output_layer_cost
from parallel.stage_layers import balanced_layer_counts, model_chunk
from tests.helpers import TINY

HEAD = 1_610_612_736 / 358_637_568  # 4.491 layers, by hand above

SHAPE = ["model.hidden_size=2048", "model.num_attention_heads=16", "model.num_kv_heads=16",
         "model.ffn_hidden_size=5632", "model.seq_length=2048", "model.vocab_size=131072",
         "parallel.pipeline=4", "parallel.stage_balance=compute"]


def split(layers: int, *overrides: str) -> list[int]:
    return chunk_layers(load_config(TINY, SHAPE + [f"model.num_layers={layers}", *overrides]))


def test_a_128k_head_costs_several_layers():
    assert output_layer_cost(load_config(TINY, SHAPE)) == pytest.approx(HEAD, rel=1e-12)
    assert HEAD == pytest.approx(4.491, abs=1e-3)


def test_1f1b_split_by_hand():
    # 32 layers, p = 4: the last stage's k layers cost k + 4.49. k = 5 gives 9.49 and leaves 27 = 9 + 9 + 9;
    # k = 4 (8.49) leaves 28, one stage 10; k = 6 costs 10.49. The embedding's stage gets no fewer layers than
    # the middle ones: it costs nothing extra. The even split's last stage costs 8 + 4.49 = 12.49.
    assert split(32) == [9, 9, 9, 5]
    assert split(32, "parallel.stage_balance=layers") == [8, 8, 8, 8]


def test_interleaved_split_by_hand():
    # p = 4, v = 2: rank r holds model chunks r and r + 4, the last rank chunks 3 and 7 (7 with the head).
    # 16 layers: rank 3 costs at least 1 + 1 + 4.49 = 6.49 (one layer a chunk), the other 14 layers go to
    # ranks 0–2 as 5, 5, 4, split within each rank 3 | 2, 3 | 2, 2 | 2. Evening out the chunks alone (every
    # chunk ≤ 5.49) gave [3, 2, 2, 2, 2, 2, 2, 1]: rank 3 at 2 + 1 + 4.49 = 7.49, the pipeline's pace.
    assert split(16, "parallel.schedule=interleaved", "parallel.virtual_stages=2") == [3, 3, 2, 1, 2, 2, 2, 1]
    # 32 layers: rank totals as 1F1B's stages, 9, 9, 9 and 5 + 4.49; rank 3's 5 as 4 | 1 + 4.49 (3 | 2 costs
    # 6.49), the others' 9 as 5 | 4.
    assert split(32, "parallel.schedule=interleaved", "parallel.virtual_stages=2") == [5, 5, 5, 4, 4, 4, 4, 1]


def test_v_placement_split_by_hand():
    # p = 4, V placement: rank r holds model chunks r and 7 − r, so rank 0 holds the embedding's chunk 0 and
    # the head's chunk 7. 32 layers: rank totals 5 + 4.49, 9, 9, 9 (as 1F1B's, on rank 0); rank 0's 5 as
    # 4 | 1 + 4.49; rank r's 9 as 5 (chunk r) | 4 (chunk 7 − r).
    assert split(32, "parallel.schedule=zbv", "parallel.virtual_stages=2") == [4, 5, 5, 5, 4, 4, 4, 1]
    # 16 layers: rank 0 keeps 1 | 1 (6.49), ranks 1–3 take 14 as 5, 5, 4: chunks 1 and 2 get 3, 6 and 5 get 2
    assert split(16, "parallel.schedule=zbv", "parallel.virtual_stages=2") == [1, 3, 3, 2, 2, 2, 2, 1]


@pytest.mark.parametrize("virtual, v_shape", [(2, False), (3, False), (2, True)])
def test_rank_totals_are_optimal_and_each_ranks_chunks_too(virtual, v_shape):
    pipeline = 2
    chunks = pipeline * virtual
    for layers, first, last in itertools.product(range(chunks, chunks + 7), (0.0, 0.7), (0.3, 2.3, 6.0)):
        extra = [first * (c == 0) + last * (c == chunks - 1) for c in range(chunks)]
        ranks = [[model_chunk(r, pipeline, j, v_shape) for j in range(virtual)] for r in range(pipeline)]
        rank_cost = lambda counts: max(sum(counts[c] + extra[c] for c in held) for held in ranks)
        splits = [tuple(b - a for a, b in zip((0,) + cuts, cuts + (layers,)))  # every split, one layer a chunk up
                  for cuts in itertools.combinations(range(1, layers), chunks - 1)]
        got = balanced_layer_counts(layers, pipeline, first, last, virtual=virtual, v_shape=v_shape)
        assert sum(got) == layers and min(got) >= 1
        assert rank_cost(got) == pytest.approx(min(rank_cost(s) for s in splits)), (layers, first, last, got)
        for held in ranks:  # within its total, no other split of a rank's chunks has a cheaper costliest chunk
            same = [s for s in splits if all(s[c] == got[c] for r in ranks if r is not held for c in r)]
            chunk_cost = lambda s: max(s[c] + extra[c] for c in held)
            assert chunk_cost(got) == pytest.approx(min(chunk_cost(s) for s in same)), (layers, held, got)
