"""The input embedding's gradient exchanged by rows (parallel/embedding_rows.py) equals the dense all-reduce: to
the bit with two ranks, within 1e-5 of the single-process run at any layout, identical on every replica."""
import pytest
import torch

from parallel import comm
from tests.distributed import worker_pools
from tests.test_data_parallel import (CURVE, assert_matches_reference, final_weights, make_trainer,
                                      single_process_run)

# 2 × 16 tokens per rank and step against a 512-row table: the rows move far fewer bytes than the table
WIDE = {**CURVE, "model": dict(CURVE["model"], vocab_size=512), "train": dict(CURVE["train"], global_batch_size=4,
                                                                              steps=6)}


@pytest.fixture(scope="module")
def pools():
    with worker_pools(2, 4) as made:
        yield made


@pytest.fixture(scope="module")
def reference():
    return single_process_run(WIDE)


def run(rank, world, base, parallel):
    """Losses, gradient norms, final weights, what each step's exchange was, the collectives of the last step,
    and whether the table's gradient was all zero after each step's zero_grad."""
    trainer = make_trainer(rank, world, base, **parallel)
    rows = trainer.data_parallel.embedding_rows
    history, exchanges, cleared = [], [], []
    for _ in range(base["train"]["steps"]):
        with comm.RECORD.capture() as events:
            history.append(trainer.train_step())
        exchanges.append(rows.last_exchange if rows else None)
        cleared.append(bool(rows.grad.eq(0).all()) if rows else None)
    collectives = [(e.op, e.bytes) for e in events]
    return ([h["loss"] for h in history], [h["grad_norm"] for h in history], final_weights(trainer), exchanges,
            collectives, cleared)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_two_ranks_equal_the_dense_all_reduce_to_the_bit(pools, precision):
    base = {**WIDE, "train": dict(WIDE["train"], precision=precision)}
    by_rows = pools[2].run(run, base, {"zero_stage": 0})
    dense = pools[2].run(run, base, {"zero_stage": 0, "embedding_row_exchange": False})
    for (losses, norms, (_, weights), exchanges, collectives, cleared), \
            (d_losses, d_norms, (_, d_weights), _, d_collectives, _) in zip(by_rows, dense):
        assert exchanges == ["rows"] * WIDE["train"]["steps"]
        assert all(cleared), "a row stayed nonzero after zero_grad"
        assert losses == d_losses and norms == d_norms
        for name, (_, [(_, _, values)]) in weights.items():
            assert torch.equal(values, d_weights[name][1][0][2]), name
        table = WIDE["model"]["vocab_size"] * WIDE["model"]["hidden_size"] * (4 if precision == "fp32" else 2)
        gathered = [b for op, b in collectives if op == "all_gather"]
        assert len(gathered) == 2 and sum(gathered) < table / 4, collectives  # the ids, then the rows
        summed = [sum(b for op, b in c if op == "all_reduce") for c in (collectives, d_collectives)]
        assert summed[1] - summed[0] == table  # the table is in no all-reduced bucket
    assert all(r[3] == [None] * WIDE["train"]["steps"] for r in dense)


@pytest.mark.parametrize("parallel", [{}, {"tensor": 2}, {"pipeline": 2}], ids=["dp4", "tp2-dp2", "pp2-dp2"])
def test_any_layout_follows_the_single_process_run_with_identical_replicas(pools, reference, parallel):
    results = pools[4].run(run, WIDE, {"zero_stage": 0, **parallel})
    tp = parallel.get("tensor", 1)
    assert_matches_reference([r[:3] for r in results], reference, tp_size=tp)
    assert any(r[3] == ["rows"] * WIDE["train"]["steps"] for r in results)  # the ranks holding the table
    copies: dict = {}
    for _, _, (tp_rank, weights), *_ in results:
        for name, (_, [(_, _, values)]) in weights.items():
            copies.setdefault((tp_rank, name), []).append(values)
    for (tp_rank, name), values in copies.items():
        assert all(torch.equal(v, values[0]) for v in values), f"{name} differs between replicas (TP rank {tp_rank})"


def test_dense_when_the_rows_would_move_more_bytes(pools):
    """CURVE: 4 × 16 tokens per rank against a 61-row table, so the table is all-reduced whole."""
    results = pools[2].run(run, {**CURVE, "train": dict(CURVE["train"], steps=2)}, {"zero_stage": 0})
    assert all(r[3] == [None, None] for r in results)  # the table sits in an all-reduced bucket


def dense_fallback(rank, world):
    """A step that read more tokens than the run's batch (the bound the table was taken out of the buckets for)
    all-reduces the table whole: the average of every rank's gradient, all rows."""
    trainer = make_trainer(rank, world, WIDE, zero_stage=0)
    rows = trainer.data_parallel.embedding_rows
    torch.manual_seed(rank)
    local = torch.randn_like(rows.grad)
    rows.grad.copy_(local)
    rows.rows_read = [torch.arange(WIDE["model"]["vocab_size"]).repeat(4)]
    rows.reduce()
    return rows.last_exchange, local, rows.grad.clone()


def test_a_step_past_the_bound_all_reduces_the_table(pools):
    results = pools[2].run(dense_fallback)
    expected = (results[0][1] / 2) + (results[1][1] / 2)
    for exchange, _, reduced in results:
        assert exchange == "dense"
        assert torch.equal(reduced, expected)


def test_the_row_exchange_reads_nothing_back_to_the_host(monkeypatch):
    """On the meta device a tensor has a shape and no values: an exchange whose shapes followed from the ids'
    values (unique, boolean indexing, .tolist() of counts) could not run there, and on a GPU each of those
    would stall the host until backward had finished."""
    from types import SimpleNamespace

    from parallel.embedding_rows import EmbeddingRows
    from parallel.tensor import TensorParallel, VocabParallelEmbedding

    embedding = VocabParallelEmbedding(512, 8, TensorParallel(None), 0.02).to("meta")
    rows = EmbeddingRows(embedding, SimpleNamespace(), 2)
    monkeypatch.setattr(comm, "all_gather_into", lambda out, shard, group, async_op=False: None)
    rows.rows_read = [torch.empty(2, 16, dtype=torch.long, device="meta")]
    rows.reduce()
    assert rows.last_exchange == "rows" and rows.touched.shape == (2 * 32,)
