"""A tokenizer's special tokens, and the one definition of "end of document" that preprocessing, training and
export share (no torch import: the offline tools use it too).

The end-of-document id is, in this order: an explicit id (`data.eod_token_id`, `--eod-token`); else the
tokenizer's own `eos_token` — from the `tokenizer_config.json` (or `special_tokens_map.json`) beside a
`tokenizer.json`, or a SentencePiece model's eos id — which is the id Megatron-LM appends (its Hugging Face
tokenizer's `eos_token_id`); else an error. Only a bare `tokenizer.json` with neither file beside it is read
by name, from `FALLBACK_NAMES`.
"""
from __future__ import annotations

import json
from pathlib import Path

ROLES = ("bos_token", "eos_token", "pad_token", "unk_token")
# For a bare tokenizer.json only (nothing declares its roles): the first name present in the vocabulary.
FALLBACK_NAMES = {"bos_token": ("<s>", "<|begin_of_text|>", "<bos>"),
                  "eos_token": ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>"),
                  "pad_token": ("<|pad|>", "<pad>"), "unk_token": ("<unk>",)}
CONFIG_FILES = ("tokenizer_config.json", "special_tokens_map.json")


def tokenizer_file(path: str | Path) -> Path:
    """The tokenizer.json or SentencePiece .model that `path` (the file or its directory) names."""
    file = Path(path)
    if file.is_dir():
        file = next((file / n for n in ("tokenizer.json", "tokenizer.model") if (file / n).is_file()),
                    file / "tokenizer.json")
    if not file.is_file():
        raise FileNotFoundError(f"tokenizer {path} does not exist; set data.tokenizer or data.eod_token_id")
    return file


def declared_roles(directory: Path) -> dict[str, str | None] | None:
    """The special-token roles that tokenizer_config.json / special_tokens_map.json declare, or None without
    either file. A role set to null stays None (declared absent); later files fill only missing roles."""
    found, any_file = {}, False
    for name in CONFIG_FILES:
        if not (directory / name).is_file():
            continue
        any_file = True
        try:
            config = json.loads((directory / name).read_text(encoding="utf-8"))
        except ValueError as exc:
            raise ValueError(f"{directory / name} is not valid JSON ({exc}); fix or remove it") from None
        for role in ROLES:
            if role in config and role not in found:
                value = config[role]
                found[role] = value.get("content") if isinstance(value, dict) else value
    return found if any_file else None


def special_tokens(path: str | Path) -> dict[str, tuple[str, int]]:
    """{role: (token text, id)} for the roles this tokenizer has (bos_token, eos_token, pad_token, unk_token)."""
    file = tokenizer_file(path)
    if file.suffix == ".model":
        import sentencepiece as spm
        sp = spm.SentencePieceProcessor(model_file=str(file))
        ids = {"bos_token": sp.bos_id(), "eos_token": sp.eos_id(), "pad_token": sp.pad_id(),
               "unk_token": sp.unk_id()}
        return {role: (sp.id_to_piece(i), i) for role, i in ids.items() if i >= 0}
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(file))
    declared = declared_roles(file.parent)
    if declared is None:
        names = {role: next((n for n in options if tok.token_to_id(n) is not None), None)
                 for role, options in FALLBACK_NAMES.items()}
    else:
        names = {role: declared.get(role) for role in ROLES}
    out = {}
    for role, name in names.items():
        if name is None:
            continue
        token_id = tok.token_to_id(name)
        if token_id is None:
            raise ValueError(f"{file.parent / CONFIG_FILES[0]}: {role} {name!r} is not in {file.name}'s "
                             f"vocabulary; fix the {role} entry")
        out[role] = (name, token_id)
    return out


def eod_id_from_tokenizer(path: str | Path) -> int:
    """The tokenizer's own end-of-document id: its eos token (see the module docstring)."""
    tokens = special_tokens(path)
    if "eos_token" in tokens:
        return tokens["eos_token"][1]
    file = tokenizer_file(path)
    if file.suffix == ".model":
        raise ValueError(f"SentencePiece model {file} has no eos piece (eos_id=-1); retrain it with an eos id "
                         f"(tools/train_tokenizer.py does) or set data.eod_token_id / --eod-token")
    if declared_roles(file.parent) is not None:
        raise ValueError(f"{file.parent / CONFIG_FILES[0]} declares no eos_token; add one (e.g. \"eos_token\": "
                         f"\"<|endoftext|>\") or set data.eod_token_id / --eod-token")
    raise ValueError(f"tokenizer {file} has no tokenizer_config.json and none of the end-of-document tokens "
                     f"{', '.join(FALLBACK_NAMES['eos_token'])}; add a tokenizer_config.json with eos_token or "
                     f"set data.eod_token_id / --eod-token")


def eod_id_or_none(path: str | Path) -> int | None:
    """eod_id_from_tokenizer, or None for a tokenizer without an end-of-document token."""
    try:
        return eod_id_from_tokenizer(path)
    except (OSError, ValueError):
        return None
