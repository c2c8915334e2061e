"""Documents inside packed samples: which document each token belongs to, its position within it, and
which tokens are trained on.

A sample is `seq_length + 1` tokens cut from the concatenation of documents, each ending with the
end-of-document token (preprocess_data.py --append-eod). By default attention and positions run across
the boundaries as if the sample were one text (GPT-style packing). Megatron-LM's three switches, with the
same semantics, treat the documents separately instead:

  reset_attention_mask  a token never attends to tokens of an earlier document in the sample;
  reset_position_ids    positions restart at 0 after each end-of-document token;
  eod_mask_loss         no loss where the *input* token is end-of-document (the first token of the next,
                        unrelated document cannot be predicted from it).

The end-of-document token belongs to the document it ends. Everything here works on the model inputs
`tokens[:, :-1]` ([b, s]), on whatever device they live; data/eod.py finds the end-of-document id.
"""
from __future__ import annotations

import torch


def document_ids(inputs: torch.Tensor, eod_id: int) -> torch.Tensor:
    """[b, s] int64: 0 for the first document of each sample, +1 after every end-of-document token."""
    ends = (inputs == eod_id).long()
    ids = torch.zeros_like(ends)
    ids[:, 1:] = ends[:, :-1].cumsum(dim=1)
    return ids


def positions_within_documents(doc_ids: torch.Tensor) -> torch.Tensor:
    """[b, s] int64: each token's offset from the start of its document."""
    s = doc_ids.shape[1]
    positions = torch.arange(s, device=doc_ids.device).expand_as(doc_ids)
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    start_of_own_document = torch.where(starts, positions, torch.zeros_like(positions)).cummax(dim=1).values
    return positions - start_of_own_document


def loss_mask(inputs: torch.Tensor, eod_id: int) -> torch.Tensor:
    """[b, s] float32: 0 where the input token is end-of-document, 1 elsewhere."""
    return (inputs != eod_id).float()
