"""ZeRO-3's input embedding looked up by rows from the shards (parallel/embedding_shards.py) trains as gathering the
table does: to the bit with two ranks, within 1e-5 of the single-process run at any layout (shards that split a
row included), moving the rows instead of the table."""
import pytest
import torch

from parallel import comm
from parallel.embedding_shards import lookup_worth_it
from tests.distributed import worker_pools
from tests.test_data_parallel import CURVE, assert_matches_reference, final_weights, make_trainer, single_process_run

# 16 tokens per micro-batch and rank against a 509-row table (16,288 elements: a quarter of it is 127.25 rows, so
# four shards split rows); 2 micro-batches per rank and step at DP 2
WIDE = {**CURVE, "model": dict(CURVE["model"], vocab_size=509),
        "train": dict(CURVE["train"], global_batch_size=4, steps=5)}


@pytest.fixture(scope="module")
def pools():
    with worker_pools(2, 4) as made:
        yield made


@pytest.fixture(scope="module")
def reference():
    return single_process_run(WIDE)


def run(rank, world, base, parallel):
    """Losses, gradient norms, final weights, whether the rows were looked up, and the last step's collectives."""
    trainer = make_trainer(rank, world, base, zero_stage=3, **parallel)
    history = []
    for _ in range(base["train"]["steps"]):
        with comm.RECORD.capture() as events:
            history.append(trainer.train_step())
    by_rows = bool(trainer.data_parallel.row_lookups)
    return ([h["loss"] for h in history], [h["grad_norm"] for h in history], final_weights(trainer), by_rows,
            [(e.op, e.bytes) for e in events])


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_two_ranks_equal_gathering_the_table_to_the_bit(pools, precision):
    base = {**WIDE, "train": dict(WIDE["train"], precision=precision)}
    rows = pools[2].run(run, base, {})
    gathered = pools[2].run(run, base, {"zero3_embedding_rows": False})
    element = 4 if precision == "fp32" else 2
    table = WIDE["model"]["vocab_size"] * WIDE["model"]["hidden_size"] * element
    for (losses, norms, (_, weights), by_rows, events), (g_losses, g_norms, (_, g_weights), g_by_rows, g_events) \
            in zip(rows, gathered):
        assert by_rows and not g_by_rows
        assert losses == g_losses and norms == g_norms
        for name, (_, [(_, _, values)]) in weights.items():
            assert torch.equal(values, g_weights[name][1][0][2]), name
        micro_batches = 2
        assert [op for op, _ in events].count("all_to_all") == micro_batches
        # the table is gathered and its gradient reduce-scattered once per micro-batch, or never
        whole = [(op, b) for op, b in g_events if b == table and op in ("all_gather", "reduce_scatter")]
        assert sorted(whole) == [("all_gather", table)] * micro_batches + [("reduce_scatter", table)] * micro_batches
        assert not [b for op, b in events if b == table]


@pytest.mark.parametrize("parallel", [{}, {"tensor": 2}, {"pipeline": 2}], ids=["dp4", "tp2-dp2", "pp2-dp2"])
def test_any_layout_follows_the_single_process_run(pools, reference, parallel):
    results = pools[4].run(run, WIDE, parallel)
    assert_matches_reference([r[:3] for r in results], reference, tp_size=parallel.get("tensor", 1))
    assert any(r[3] for r in results)  # the ranks holding the table looked it up by rows


def test_the_table_is_gathered_when_the_rows_would_move_more(pools):
    """4 ranks × 16 tokens of 264 bytes each against a 61-row table of 128-byte rows: gathered whole."""
    assert not lookup_worth_it(61, 32, 4, 4, 16) and lookup_worth_it(61, 32, 4, 2, 16)
    results = pools[4].run(run, {**CURVE, "train": dict(CURVE["train"], steps=1)}, {})
    assert not any(r[3] for r in results)


def evaluate_after_training(rank, world):
    """A forward without gradient (evaluation) gathers the table as before and gives the same logits."""
    trainer = make_trainer(rank, world, WIDE, zero_stage=3)
    trainer.train_step()
    chunk = trainer.chunks[0]
    ids = torch.arange(16).view(1, 16) * 31 % WIDE["model"]["vocab_size"]
    with torch.no_grad():
        with comm.RECORD.capture() as events:
            logits = chunk(ids)
    return logits, [op for op in (e.op for e in events)]


def test_evaluation_forwards_gather_the_table(pools):
    results = pools[2].run(evaluate_after_training)
    for logits, ops in results:
        assert "all_to_all" not in ops and "all_gather" in ops
        assert torch.equal(logits, results[0][0])
