"""The tokenizer half of a Hugging Face export: files that transformers 4.5x and 5.x both load as they are.

A `tokenizer.json` is copied byte for byte with a `tokenizer_config.json` naming `PreTrainedTokenizerFast`
(transformers 5 would write `TokenizersBackend`, which 4.x cannot import; both generations read tokenizer.json
verbatim through `PreTrainedTokenizerFast`). The source's own tokenizer_config.json fields (chat template,
model_max_length, ...) are kept. A SentencePiece model is written both as `tokenizer.model` (what llama.cpp's
converter reads) and as the equivalent `tokenizer.json`, so that neither transformers generation converts it
itself: their own conversions differ (transformers 5's drops the model's whitespace handling, so " one"
encodes differently from SentencePiece). The config states every role, so transformers invents no `<s>`/`</s>`.

The special tokens are the tokenizer's own (data/eod.py), with the end of document overridden by
`data.eod_token_id` — the same id preprocessing appended and training masked.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from data.eod import CONFIG_FILES, ROLES, special_tokens, tokenizer_file


class TokenizerExportError(ValueError):
    """A tokenizer that cannot be exported as given; the message names the file and the fix."""


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


def spm_merges(pieces: list[tuple[str, float]]) -> list[tuple[str, str]]:
    """BPE merges of a SentencePiece BPE model: every split of a piece into two pieces, the pieces ranked by
    score (SentencePiece merges the best-scoring result first), splits by their parts' ids."""
    ids = {piece: i for i, (piece, _) in enumerate(pieces)}
    ranked = sorted(range(len(pieces)), key=lambda i: -pieces[i][1])
    merges = []
    for i in ranked:
        piece = pieces[i][0]
        splits = [(piece[:k], piece[k:]) for k in range(1, len(piece)) if piece[:k] in ids and piece[k:] in ids]
        merges.extend(sorted(splits, key=lambda lr: (ids[lr[0]], ids[lr[1]])))
    return merges


def sentencepiece_json(file: Path):
    """A `tokenizers` Tokenizer that encodes as the SentencePiece model does (normalizer, dummy prefix,
    whitespace, byte fallback, user-defined pieces matched in the text, control pieces special)."""
    from sentencepiece import sentencepiece_model_pb2
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(file.read_bytes())
    pieces = [(p.piece, p.score) for p in proto.pieces]
    trainer, spec = proto.trainer_spec, proto.normalizer_spec
    if trainer.model_type == 1:
        model = models.Unigram(pieces, unk_id=trainer.unk_id, byte_fallback=trainer.byte_fallback)
    elif trainer.model_type == 2:
        model = models.BPE({p: i for i, (p, _) in enumerate(pieces)}, spm_merges(pieces),
                           unk_token=pieces[trainer.unk_id][0], fuse_unk=True, byte_fallback=trainer.byte_fallback)
    else:
        raise TokenizerExportError(f"{file} is a SentencePiece model of type {trainer.model_type}; the export "
                                   f"takes unigram and BPE models")
    tok = Tokenizer(model)
    steps = [normalizers.Precompiled(spec.precompiled_charsmap)] if spec.precompiled_charsmap else []
    if spec.remove_extra_whitespaces:
        steps += [normalizers.Strip(), normalizers.Replace(Regex(" {2,}"), " ")]
    steps += ([normalizers.Prepend("▁")] if spec.add_dummy_prefix else []) + [normalizers.Replace(" ", "▁")]
    tok.normalizer = normalizers.Sequence(steps)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
                                    + ([decoders.Strip(" ", 1, 0)] if spec.add_dummy_prefix else []))
    tok.add_tokens([AddedToken(p.piece, normalized=False, special=p.type == 3) for p in proto.pieces
                    if p.type in (3, 4)])  # 3: control, 4: user-defined
    return tok


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
        # No post-processor: Trilith's preprocessing encodes SentencePiece text without bos/eos.
        sentencepiece_json(file).save(str(out / "tokenizer.json"))
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
