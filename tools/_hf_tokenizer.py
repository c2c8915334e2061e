"""The tokenizer half of a Hugging Face export: files that transformers 4.5x and 5.x both load as they are.

A `tokenizer.json` is copied byte for byte with a `tokenizer_config.json` naming `PreTrainedTokenizerFast`
(transformers 5 would write `TokenizersBackend`, which 4.x cannot import; both generations read tokenizer.json
verbatim through `PreTrainedTokenizerFast`). The source's own tokenizer_config.json fields (chat template,
model_max_length, ...) are kept. A SentencePiece model becomes `tokenizer.model` with a `LlamaTokenizer`
config (needs `sentencepiece` and `protobuf`) that states every role, so transformers invents no `<s>`/`</s>`.

The special tokens are the tokenizer's own (data/eod.py), with the end of document overridden by
`data.eod_token_id` — the same id preprocessing appended and training masked.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from data.eod import CONFIG_FILES, ROLES, special_tokens, tokenizer_file


class TokenizerExportError(ValueError):
    pass


def _token_text(file: Path, token_id: int) -> str | None:
    if file.suffix == ".model":
        import sentencepiece as spm
        sp = spm.SentencePieceProcessor(model_file=str(file))
        return sp.id_to_piece(token_id) if 0 <= token_id < sp.get_piece_size() else None
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(file)).id_to_token(token_id)


def export_roles(path: str | Path, eod_token_id: int = -1) -> dict[str, tuple[str, int]]:
    """{role: (text, id)} of the export: the tokenizer's roles, eos replaced by `eod_token_id` when set."""
    file = tokenizer_file(path)
    roles = special_tokens(file)
    if eod_token_id >= 0:
        text = _token_text(file, eod_token_id)
        if text is None:
            raise TokenizerExportError(f"data.eod_token_id={eod_token_id} is not a token of {file}; set it to an "
                                       f"id of that vocabulary or to -1 (the tokenizer's eos_token)")
        roles["eos_token"] = (text, eod_token_id)
    return roles


def _source_config(file: Path) -> dict:
    config_file = file.parent / CONFIG_FILES[0]
    if file.suffix != ".json" or not config_file.is_file():
        return {}
    config = json.loads(config_file.read_text(encoding="utf-8"))
    # Ids of added tokens are in tokenizer.json already; auto_map would point at code that is not exported.
    for key in ("added_tokens_decoder", "auto_map", "tokenizer_file", "name_or_path"):
        config.pop(key, None)
    return config


def export_tokenizer(path: str | Path, out: Path, eod_token_id: int = -1,
                     model_max_length: int | None = None) -> dict[str, int | None]:
    """Write the tokenizer files into `out`; returns {bos_token_id, eos_token_id, pad_token_id} for config.json."""
    file = tokenizer_file(path)
    roles = export_roles(file, eod_token_id)
    config = _source_config(file)
    if file.suffix == ".model":
        shutil.copyfile(file, out / "tokenizer.model")
        # Trilith's preprocessing encodes without bos/eos, so the exported tokenizer adds none either.
        config.update(tokenizer_class="LlamaTokenizer", add_bos_token=False, add_eos_token=False, legacy=True,
                      sp_model_kwargs={}, spaces_between_special_tokens=False)
    else:
        shutil.copyfile(file, out / "tokenizer.json")
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config.update({role: roles[role][0] if role in roles else None for role in ROLES})
    config.setdefault("clean_up_tokenization_spaces", False)
    if model_max_length:
        config.setdefault("model_max_length", model_max_length)
    (out / CONFIG_FILES[0]).write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    (out / CONFIG_FILES[1]).write_text(json.dumps({role: roles[role][0] for role in ROLES if role in roles},
                                                  indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return {f"{role}_id": roles[role][1] if role in roles else None for role in ("bos_token", "eos_token",
                                                                                  "pad_token")}
