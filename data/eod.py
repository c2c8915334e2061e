"""The end-of-document token id of a tokenizer (no torch import: the offline tools use it too)."""
from __future__ import annotations

from pathlib import Path

EOD_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")


def eod_id_from_tokenizer(path: str) -> int:
    """The end-of-document id of a tokenizer.json or SentencePiece .model, by the usual token names."""
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"tokenizer {path} does not exist; set data.tokenizer or data.eod_token_id")
    if file.suffix == ".model":
        import sentencepiece as spm
        sp = spm.SentencePieceProcessor(model_file=str(file))
        if sp.eos_id() >= 0:
            return sp.eos_id()
        found = [sp.piece_to_id(n) for n in EOD_NAMES if sp.piece_to_id(n) != sp.unk_id()]
    else:
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(str(file))
        found = [tok.token_to_id(n) for n in EOD_NAMES if tok.token_to_id(n) is not None]
    if not found:
        raise ValueError(f"tokenizer {path} has none of the end-of-document tokens {', '.join(EOD_NAMES)}; "
                         f"set data.eod_token_id")
    return found[0]
