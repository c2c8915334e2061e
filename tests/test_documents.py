"""Documents packed into one sample (data/documents.py): with reset_attention_mask + reset_position_ids a
packed sample must give exactly what each document gives on its own, forward and backward, on every
attention backend this machine has (max abs ≤ 1e-5, fp32); eod_mask_loss must drop exactly the tokens
after an end-of-document token. Layout independence (TP + SP + PP) is in tests/test_pipeline.py."""
import dataclasses

import pytest
import torch

from data.documents import document_ids, loss_mask, positions_within_documents
from data.eod import eod_id_from_tokenizer
from engine.config.schema import ConfigError, ModelConfig, load_config, validate
from engine.model import CausalLM
from parallel.micro_batch import MicroBatch
from tests.helpers import tiny_trainer

EOD = 1
CFG = ModelConfig(hidden_size=64, num_layers=2, num_attention_heads=4, num_kv_heads=2, ffn_hidden_size=96,
                  vocab_size=50, seq_length=20, loss_chunk_tokens=7)


def test_ids_positions_and_mask_of_a_packed_sample():
    inputs = torch.tensor([[5, EOD, 7, 8, EOD, 9], [EOD, EOD, 3, 4, 5, 6]])
    ids = document_ids(inputs, EOD)
    assert ids.tolist() == [[0, 0, 1, 1, 1, 2], [0, 1, 2, 2, 2, 2]]
    assert positions_within_documents(ids).tolist() == [[0, 1, 0, 1, 2, 0], [0, 0, 0, 1, 2, 3]]
    assert loss_mask(inputs, EOD).tolist() == [[1, 0, 1, 1, 0, 1], [0, 0, 1, 1, 1, 1]]


def _documents(lengths, seed=0):
    """Documents of these lengths, each ending with EOD except the last (cut by the sample boundary)."""
    gen = torch.Generator().manual_seed(seed)
    docs = [torch.randint(2, CFG.vocab_size, (n,), generator=gen) for n in lengths]
    for doc in docs[:-1]:
        doc[-1] = EOD
    return docs


def _model(cfg):
    model = CausalLM(cfg)
    model.init_weights(7)
    return model


@pytest.mark.parametrize("backend", ["sdpa", "reference"])
@pytest.mark.parametrize("position", ["rope", "alibi"])
def test_packed_sample_equals_its_documents_run_alone(backend, position):
    cfg = dataclasses.replace(CFG, attention_backend=backend, position_embedding=position)
    model = _model(cfg)
    docs = _documents([6, 9, 6])  # 21 tokens = seq_length + 1
    tokens = torch.cat(docs)[None]
    inputs = tokens[:, :-1]
    ids = document_ids(inputs, EOD)
    packed = model(inputs, segment_ids=ids,
                   position_ids=positions_within_documents(ids) if position == "rope" else None)
    alone = torch.cat([model(doc[None, :-1] if i == len(docs) - 1 else doc[None]) for i, doc in enumerate(docs)],
                      dim=1)
    assert packed.shape == alone.shape
    torch.testing.assert_close(packed, alone, rtol=0, atol=1e-5, check_dtype=False)
    plain = model(inputs)  # without the switches the later documents see the earlier ones
    assert (plain[:, 6:] - alone[:, 6:]).abs().max() > 1e-3


def test_loss_and_gradients_equal_the_documents_trained_alone():
    model = _model(CFG)
    docs = _documents([6, 9, 6], seed=1)
    tokens = torch.cat(docs)[None]
    inputs = tokens[:, :-1]
    ids = document_ids(inputs, EOD)
    mb = MicroBatch(tokens, ids, positions_within_documents(ids), loss_mask(inputs, EOD))
    args, kwargs = mb.forward_args(first=True, last=True)
    model(*args, **kwargs).backward()
    packed = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    # Alone: each document's tokens predict their successors inside it; the EOD predicts nothing.
    total, count = 0.0, 0
    for doc in docs:
        losses = torch.nn.functional.cross_entropy(model(doc[None, :-1])[0], doc[1:], reduction="none")
        total, count = total + losses.sum(), count + losses.numel()
    (total / count).backward()
    assert count == int(mb.loss_mask.sum())
    for n, p in model.named_parameters():
        torch.testing.assert_close(packed[n], p.grad, rtol=0, atol=1e-5, check_dtype=False, msg=lambda m: f"{n}: {m}")


def _trainer(*overrides):
    return tiny_trainer("model.num_layers=2", "model.vocab_size=40", *overrides, validated=True)


def test_trainer_builds_the_extras_the_config_asks_for():
    tokens = torch.tensor([[4, 5, 6, 7, 8, 6, 9, 10, 11]])
    mb = _trainer("data.reset_attention_mask=true", "data.eod_token_id=6").micro_batch(tokens)
    assert mb.segment_ids.tolist() == [[0, 0, 0, 1, 1, 1, 2, 2]] and mb.position_ids is None and mb.loss_mask is None
    mb = _trainer("data.reset_position_ids=true", "data.eod_mask_loss=true", "data.eod_token_id=6").micro_batch(tokens)
    assert mb.segment_ids is None and mb.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 0, 1]]
    assert mb.loss_mask.tolist() == [[1, 1, 0, 1, 1, 0, 1, 1]]
    assert _trainer().micro_batch(tokens).segment_ids is None


def test_end_of_document_id_comes_from_the_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models
    tok = Tokenizer(models.WordLevel({"a": 0, "b": 1, "</s>": 2}, unk_token="a"))
    tok.save(str(tmp_path / "tokenizer.json"))
    assert eod_id_from_tokenizer(str(tmp_path / "tokenizer.json")) == 2
    trainer = _trainer("data.eod_mask_loss=true", f"data.tokenizer={tmp_path / 'tokenizer.json'}")
    assert trainer.eod_id == 2
    Tokenizer(models.WordLevel({"a": 0}, unk_token="a")).save(str(tmp_path / "plain.json"))
    with pytest.raises(ConfigError, match="none of the end-of-document tokens"):
        _trainer("data.eod_mask_loss=true", f"data.tokenizer={tmp_path / 'plain.json'}")
    with pytest.raises(ConfigError, match="does not exist"):
        _trainer("data.eod_mask_loss=true", f"data.tokenizer={tmp_path / 'missing.json'}")


@pytest.mark.parametrize("overrides, message", [
    (["data.reset_attention_mask=true"], "need the end-of-document token"),
    (["data.eod_mask_loss=true", "data.eod_token_id=300"], "outside model.vocab_size"),
    (["data.reset_position_ids=true", "data.eod_token_id=3", "model.position_embedding=alibi"], "needs model"),
])
def test_document_switches_are_validated(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(load_config("launch/configs/tiny.yaml", overrides), 1)
