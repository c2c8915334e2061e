r"""An exact fast engine for the chunk cache's misses: tiktoken (Rust) for byte-level BPE vocabularies.

`tiktoken_engine(config, tokenizer)` gives (engine, None) or (None, why not), decided from what the
tokenizer.json holds, then checked against `tokenizers` on a sample of Chinese, Japanese, Korean, mixed
CJK/Latin/emoji text and code. `engine.encode(chunks)` -> (ids, tokens per chunk) of the chunks the cache
(data/offline/encoder.py) missed, each encoded alone. The normalizer needs no reproducing: the cache encodes
normalized text, and sends documents holding added tokens' text to the tokenizer itself.

Why tiktoken gives the tokenizer's ids. Both split a text with the same regex and encode each piece on its
own. `tokenizers`' BPE repeatedly joins the adjacent pair of symbols that is a merge of the lowest rank (the
leftmost of equal ones); tiktoken joins the adjacent pair whose concatenation is a token of the lowest rank
(the leftmost), and returns a piece that is a token as that token. Give tiktoken the rank 256 + i to the
result of merge i (bytes: their value), and require: (a) the model is plain BPE (no dropout, subword prefix
or suffix, byte fallback), over the 256 byte-level characters, all in the vocabulary; (b) no pair and no
result repeats among the merges, and every merge's result is its parts joined; (c) every token of two or more
bytes encodes, by the merges alone, to itself. Then, at any state of `tokenizers`' BPE, an adjacent pair p, q
whose concatenation t is a token is the merge that makes t: the place before p and after q has never been
crossed (symbols only grow), so the merges inside t so far are those t alone would make, in the same order;
alone, t goes from [p, q] to [t] by (c), which only the merge (p, q) can do, and by (b) it is t's merge. So
the pairs tiktoken may join are the pairs `tokenizers` may join, with the same order of ranks and the same
tie-break, and by induction both go through the same states; a piece that is a token is that token in both,
by (c). The Unicode tables of the two regex engines (Oniguruma, fancy-regex) could still differ on newly
assigned characters: the sample check at load and the cache's check of each process's first documents
compare against `tokenizers` itself.
"""
import functools
import itertools

import numpy as np

# Oniguruma and fancy-regex read these patterns alike: the GPT-2 ByteLevel regex, and chunk_rules.SPLIT_PATTERNS.
GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
SAMPLE = (
    "中华人民共和国成立于1949年，首都北京。今天的天气很好，我们去公园散步吧！",
    "１２月３１日，新华社记者报道：ＷＴＯ谈判取得进展（附图片１张）。",
    "東京は朝から晴れています。カタカナとひらがな、漢字が混ざった文章です。",
    "오늘은 아침부터 비가 와서 하루 종일 도서관에서 책을 읽었습니다.",
    "Hello 世界! GPT-4o 和 Llama 3 的 tokenizer 🤖🚀 emoji 👨‍👩‍👧 test… “quotes” — dash\n",
    "def f(x):\n    return x + 1  # 注释\n\n\tmixed\ttabs  and   spaces\r\n",
    "It's 2024, isn't it?  3.14159 and 42. café naïve ÅÉÎÕÜ ß ﬁ",
)


@functools.lru_cache(maxsize=1)
def byte_chars():
    """{byte-level character: its byte}: GPT-2's map of bytes to printable characters."""
    from tokenizers import pre_tokenizers
    printable = [b for b in range(256) if 0x21 <= b <= 0x7E or 0xA1 <= b <= 0xAC or 0xAE <= b <= 0xFF]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    assert set(chars) == set(pre_tokenizers.ByteLevel.alphabet())
    return chars


def _pattern(config, rule_name):
    pre = config.get("pre_tokenizer") or {}
    if rule_name == "GPT-2 byte-level":
        return GPT2_PATTERN
    return pre["pretokenizers"][0]["pattern"]["Regex"]


def _structure(model, vocab):
    """(ranked merges as bytes, the token id of each rank) or a reason why tiktoken may differ."""
    if model.get("type") != "BPE":
        return f"a {model.get('type')} model"
    if model.get("dropout"):
        return "BPE dropout makes encoding random"
    if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        return "a BPE subword prefix or suffix"
    if model.get("byte_fallback"):
        return "byte fallback"
    chars = byte_chars()
    if any(c not in vocab for c in chars):
        return "a vocabulary without all 256 byte-level characters"
    pairs = [tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1)) for m in model.get("merges") or ()]
    made = ["".join(p) for p in pairs]
    if len(set(pairs)) != len(pairs) or len(set(made)) != len(made):
        return "merges that repeat a pair or a result"
    if any(t not in vocab for t in made):
        return "a merge whose result is not in the vocabulary"
    if not set("".join(made)) <= chars.keys():
        return "a merge of characters outside the byte-level map"
    ranks = {bytes([b]): b for b in range(256)}
    to_latin1 = str.maketrans({c: chr(b) for c, b in chars.items()})  # a token's bytes, by one C call each
    ranks.update((t.translate(to_latin1).encode("latin-1"), 256 + i) for i, t in enumerate(made))
    ids = np.asarray([vocab[c] for c in sorted(chars, key=chars.get)] + [vocab[t] for t in made], np.int64)
    return ranks, ids, made


def tiktoken_engine(config, tokenizer, rule_name):
    """(TiktokenEngine, None) or (None, why it is off) for a tokenizer whose cache cuts with `rule_name`."""
    if rule_name not in ("GPT-2 byte-level", "regex Split + ByteLevel"):
        return None, f"not a byte-level BPE with a regex split ({rule_name} cuts)"
    try:
        import tiktoken
    except ImportError:
        return None, "tiktoken is not installed (pip install tiktoken, the fast extra)"
    from tokenizers import models
    model, vocab = config.get("model") or {}, tokenizer.get_vocab(with_added_tokens=False)
    found = _structure(model, vocab)
    if isinstance(found, str):
        return None, found
    ranks, ids, made = found
    # (c): every merged token encodes to itself by the merges alone (the tokenizer's own model unless it has
    # ignore_merges, which would find each token whole). The model's own tokenize, a token at a time: half the
    # CPU of a batch encode through a Tokenizer (0.08 s against 0.15 s for 31,742 merges).
    merges_only = (tokenizer.model if not model.get("ignore_merges") else models.BPE(
        vocab, [tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1)) for m in model["merges"]],
        ignore_merges=False))
    for token in made:
        found = merges_only.tokenize(token)
        if len(found) != 1 or found[0].id != vocab[token]:
            return None, f"the token {token!r} does not encode to itself by the merges"
    try:
        encoding = tiktoken.Encoding("trilith", pat_str=_pattern(config, rule_name), mergeable_ranks=ranks,
                                     special_tokens={})
    except ValueError as e:
        return None, f"tiktoken refuses the pre-tokenizer regex ({e})"
    return TiktokenEngine(encoding, ids), None


class TiktokenEngine:
    name = "tiktoken"

    def __init__(self, encoding, ids):
        self._core = encoding._core_bpe  # its encode_ordinary: the public one adds a check per call
        self._ids = ids  # token id of each tiktoken rank

    def encode(self, chunks):
        """(ids, tokens per chunk) of chunks, each encoded alone."""
        encoded = list(map(self._core.encode_ordinary, chunks))
        counts = np.fromiter(map(len, encoded), np.int64, len(encoded))
        ranks = np.fromiter(itertools.chain.from_iterable(encoded), np.int64, int(counts.sum()))
        return self._ids[ranks], counts

    def agrees(self, inner, rule):
        """None when the engine encodes SAMPLE's chunks as `inner` (the tokenizer, no normalizer or template)
        does, else the first text where it differs."""
        for text in itertools.chain(SAMPLE, ["".join(SAMPLE)]):
            chunks = rule.split(text)
            ids, counts = self.encode(chunks)
            ref = inner.encode_batch(chunks, add_special_tokens=False)
            if ids.tolist() != [i for e in ref for i in e.ids] or counts.tolist() != [len(e.ids) for e in ref]:
                return text
        return None
