"""Text ↔ token ids for evaluation and generation, from a tokenizer.json (what tools/train_tokenizer.py
writes and what a Hugging Face export carries). Encoding adds no special tokens, as
lm-evaluation-harness encodes contexts and continuations for causal models."""
from __future__ import annotations

from pathlib import Path


class TextTokenizer:
    def __init__(self, path: str | Path, what: str = "data.tokenizer"):
        path = Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        if path.suffix != ".json" or not path.is_file():
            raise ValueError(f"{what}={path}: evaluation and generation need a tokenizer.json file (convert a "
                             f"SentencePiece model by exporting it: tools/ckpt_convert.py --to hf writes one)")
        from tokenizers import Tokenizer
        try:
            self.tokenizer = Tokenizer.from_file(str(path))
        except Exception as exc:  # the tokenizers library raises its own exception type
            raise ValueError(f"{what}={path} is not a readable tokenizer.json ({exc})") from exc
        self.path = path

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)
