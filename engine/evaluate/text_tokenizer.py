"""Text ↔ token ids for evaluation and generation, from a tokenizer.json (what tools/train_tokenizer.py
writes and what a Hugging Face export carries). `encode` adds no special tokens (generation prompts, as
Trilith's preprocessing encodes text); `encode_as_harness` encodes as lm-evaluation-harness 0.4's Hugging
Face backend does for scoring, and `prefix_id` is that backend's prefix token."""
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

    def prefix_id(self, eod: int | None) -> int | None:
        """lm-evaluation-harness's prefix token (HFLM.prefix_token_id): the BOS token that the tokenizer's
        tokenizer_config.json / special_tokens_map.json declare, else its EOS, which is the end-of-document
        token `eod`."""
        from data.eod import special_tokens
        bos = special_tokens(self.path).get("bos_token")
        return bos[1] if bos else eod

    def encode_as_harness(self, text: str, prefix: int | None) -> list[int]:
        """lm-evaluation-harness's HFLM.tok_encode: the tokenizer's own special tokens (its post-processor,
        a BOS for Llama tokenizers, nothing for Trilith's), unless the text already starts with the prefix
        token's text."""
        begins = prefix is not None and text.startswith(self.tokenizer.decode([prefix], skip_special_tokens=False))
        return self.tokenizer.encode(text, add_special_tokens=not begins).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)
