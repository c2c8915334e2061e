r"""Where a document may be cut for the exact chunk cache (data/offline/encoder.py), per pre-tokenizer family.

A cut is safe when it is a boundary of the tokenizer's own pre-tokenization on every text, and the pieces
after it do not depend on the text before it: then a document's ids are the concatenation of its chunks'
ids, each chunk encoded alone. The cuts are found with Python's `re` (fast), at places the tokenizer's
rules make boundaries for a reason stated below; misses are encoded by the tokenizer itself, and the
first documents of every process are checked against the plain encoder.

- GPT-2 byte-level (`ByteLevel` with its built-in regex): see _encoder.py's docstring.
- Regex `Split` + `ByteLevel(use_regex=False)` (Llama 3, Qwen2, GPT-4's cl100k): with the patterns in
  SPLIT_PATTERNS every character is matched (no gaps) and the patterns only look ahead, so matching
  resumes at a boundary as at a text's start. No alternative matches a non-whitespace character followed
  by a space or tab, so a space or tab after one starts a piece. Inside a whitespace run, `\s*[\r\n]+`
  (tried before the `\s+` alternatives) ends a piece at the run's LAST line break, and a punctuation piece
  takes only line breaks: a space or tab after the last line break starts a piece. A run of spaces or tabs
  before a non-whitespace character gives all but its last character to `\s+(?!\S)`: its last one starts
  a piece.
- `Metaspace` (Llama 2, Mistral): spaces become "▁". With `split` true the pre-tokenizer cuts before every "▁"
  itself. With `split` false (converted Llama 2 and Mistral tokenizers) the whole text is one piece for the
  model, so with a BPE model only the merges decide where tokens may span. BPE starts
  from one symbol per character (a character outside the vocabulary: its bytes' tokens, or the unknown token,
  consecutive ones fused) and every later symbol is a merge's result. Take a position p in the "▁"-replaced text
  with a "▁" at p and another character c before it. "▁" is a vocabulary entry, so the symbol at p starts with
  "▁" and no unknown run crosses p; the symbol ending before p ends with c, with ">" of a byte token "<0xNN>",
  or with the last character of the unknown token's text (not "▁"). A merge that joined the two would therefore
  make a token whose text holds a character other than "▁" followed by "▁". When no merge makes one, no symbol
  ever spans p: the merges on either side never meet, and the heap of merges (lowest rank, then leftmost)
  applies each side's merges in the order that side alone would. So a text's ids are the concatenation of its
  chunks' ids, a chunk being a run of spaces (or "▁") and the text up to the next one. Converted Llama 2 and
  Mistral vocabularies qualify: their only tokens with an inner "▁" are whitespace runs ("▁▁", "▁▁▁▁", ...),
  and a run followed by a word would too. When no merge makes a token with "▁" after its first character at
  all, a cut before every space is exact, a finer rule that keeps indentation out of the words' chunks. Not
  covered, so encoded whole: `ignore_merges` (a whole text found in the vocabulary is one token), a
  `continuing_subword_prefix` or `end_of_word_suffix`, a vocabulary without "▁" itself, and other models. A
  chunk starting with a space gets no second "▁" prepended; a document's first chunk gets the one the
  document gets.

  Even runs. A whitespace-run chunk "▁"*n + w (w without "▁", the chunk at a cut) is encoded as "▁▁" + w when n
  is even, its first token (the one "▁▁") then replaced by the ids of "▁"*n alone. This is exact when, besides
  the above, the merge ("▁", "▁") has the lowest rank among the merges of two runs of "▁" and those whose left
  part is "▁", and no merge makes a token holding "▁▁" followed by another character. The last "▁", at n - 1,
  can then end up only in a run token or in a token starting at n - 1 (one starting earlier would hold "▁▁"
  and w's first character). Before any merge touches the run, its pairs are all ("▁", "▁"), of that lowest
  rank r, while a merge joining n - 1 to w has a higher one, and w's own merges never touch the run. So the
  run's first merges are its pairs at rank r,
  applied left to right (the heap takes the leftmost of equal ranks, and a pair whose left "▁" was just merged
  is stale): (0, 1), (2, 3), ..., and for n even (n - 2, n - 1) joins the last "▁" to the run before anything
  can join it to w. Merges pushed meanwhile rank above r (runs of "▁", or "▁▁" + w's start, which no merge
  makes). From then on no merge crosses n, as no merge makes "▁▁" + another character: the run and w are
  encoded independently, as each alone, w without a "▁" before it, for every even n alike. So the chunk's ids
  are the run's ids, then those of "▁▁" + w after the token "▁▁" (one token: the merge ("▁", "▁")). With the
  lowest rank of all, as in converted Llama 2 vocabularies ("▁▁" is Llama 2's best-scored piece), the
  condition holds; a vocabulary where it fails keeps whole whitespace-run chunks. Python code indents by even runs, so the misses hold far fewer characters.

  Pieces. The new chunks (after the even-run shortening, spaces written "▁", as the model sees them) are cut
  again wherever no token can span, and each distinct piece is encoded once, as a text of its own
  (data/offline/pieces.py). With the model as above, and when no merge has a part that is a byte token
  "<0xNN>" (with byte fallback) or the unknown token, every symbol is a vocabulary entry whose text is the
  substring it covers: true of the first symbols (one per character) other than byte and unknown tokens, which
  no merge then takes, and kept by every merge, whose result is its parts' texts joined. Take characters a, b
  adjacent in the text such that no merge's result holds "ab", and not both outside the vocabulary (fused
  unknowns form one symbol over such a run). Their first symbols are distinct, and a symbol spanning the place
  between them would be a merge's result holding "ab": none ever does. So the merges on either side never
  meet, each side makes the merges it would make alone (lowest rank, then leftmost, in the order that side
  alone would), and the text's ids are its pieces' ids in order. Chunk boundaries are such places (no merge
  makes a character other than "▁" followed by "▁"), so a chunk's ids are its pieces'. A vocabulary with a merge
  of a byte or unknown token keeps whole chunks, and the summary says why. The same argument needs less: a
  symbol spanning the place is a merge's result t whose text occurs there, t = u + v with u ending the text
  before the place and v starting the text after it. So with `--context-cuts` a place is cut wherever no merge's
  result occurs across it in the text (a merge that makes "中国人" rules out the place in "中国人" but not in
  "美国人"), found by data/offline/pieces.py's SpanFinder.

- Pieces of byte-level chunks (GPT-2 and Split, with `--context-cuts`). A line of Chinese has no space: it is one
  chunk and one pre-token, which rarely repeats. Take a place between two CJK letters X and Y (kana, Hangul
  syllables, CJK ideographs: no case folding touches them; "letters" as the tokenizer's own regex engine reads
  them, checked at load by pre-tokenizing "a" followed by all of them). Of the regexes' alternatives only
  ` ?\p{L}+` (GPT-2) and `[^\r\n\p{L}\p{N}]?\p{L}+` (Split) match a CJK letter (a contraction holds only ASCII
  letters), so X's pre-token runs on through Y to the end of the letter run, and no match before it reads past X.
  The chunk's text up to the place therefore pre-tokenizes as before, its last pre-token cut at the place, and the
  text from Y on as the rest of the run and then the same pre-tokens (the regexes only look ahead). BPE then works
  in the byte-level alphabet with the 256 bytes as its first symbols and every later one a merge's result whose
  text is its parts' (made of those characters; a merge of others voids the cut); so, as above, when no merge's
  result occurs across the place in the UTF-8 bytes, the run's two sides encode as each alone, and a chunk's ids
  are its pieces' (each piece encoded as a text of its own, by tiktoken or `tokenizers`). Not covered, so no
  pieces: `ignore_merges` (a piece that is a token would be that token whatever the merges make), a subword
  prefix or suffix, other models.

Documents holding whitespace that Python's `re` and the tokenizer's regex engine may classify differently
(OTHER_SPACES in _encoder.py) go to the plain encoder.
"""
import re

# Python's `\s` and Oniguruma's `\s` agree on these four; other characters that Python calls
# whitespace (str.isspace) send the document to the plain encoder.
SAFE_SPACES = " \t\n\r"
OTHER_SPACES = ("\x0b\x0c\x1c\x1d\x1e\x1f\x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006"
                "\u2007\u2008\u2009\u200a\u2028\u2029\u202f\u205f\u3000")
# GPT-2: more exact cuts, from the same regex: a whitespace run W before a non-space splits into the
# pieces W[:-1] and W[-1] + what follows (`\s+(?!\S)` backs off one character); an ASCII letter or
# digit followed by ASCII punctuation ends a piece. Cutting there keeps indentation and
# identifiers' surroundings out of the chunks, so far fewer distinct chunks need encoding.
_PUNCT = "!-/:-@\\[-`{-~"
_GPT2_CHUNK_RE = re.compile(
    r"[ \t\n\r]+(?=[ \t\n\r][^ \t\n\r])|[ \t\n\r]+\Z"
    r"|[ \t\n\r]?(?=[^ \t\n\r])(?:[^ \t\n\rA-Za-z0-9]++|[A-Za-z0-9]++(?![" + _PUNCT + r"]))*+[A-Za-z0-9]*+")
# The Split patterns of Llama 3 (= GPT-4's cl100k) and Qwen2 tokenizer.json files.
SPLIT_PATTERNS = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+",
)
# Cuts for SPLIT_PATTERNS: before a space or tab that follows a non-whitespace character; after the last
# line break of a whitespace run (a space or tab run followed by a line break stays in its chunk); before
# the last space or tab of a run followed by a non-whitespace character (`\s+(?!\S)` leaves it to the next
# piece); and where an ASCII letter or digit is followed by ASCII punctuation (no alternative holds one
# after the other), which keeps identifiers out of the chunks of code.
_SPLIT_CHUNK_RE = re.compile(
    r"[ \t]+(?=[ \t][^ \t\n\r])"
    r"|(?=[\s\S])[ \t]*+(?:[^ \t\n\rA-Za-z0-9]++|[\n\r]++|[ \t]++(?=[\n\r])|[A-Za-z0-9]++(?![" + _PUNCT + r"]))*+"
    r"[A-Za-z0-9]*+")
# Metaspace: a run of spaces is one chunk but for its last space, which starts the next word's chunk (any
# cut before a space is exact; these keep indentation out of the words' chunks).
_SPACE_CHUNK_RE = re.compile(r" +(?= )| [^ ]*+|[^ ]++")


class CutRule:
    """How documents of one pre-tokenizer family are cut into chunks.

    `alone(chunk)`, if given: the chunk must be encoded as a text of its own (a Metaspace chunk without a
    leading space gets the "▁" a text's start gets); the others are encoded many at a time. By default as
    the words of a pre-tokenized input; with `joined_pre_tokenizer` (the pre-tokenizer's config -> one
    under which the concatenated chunks, passed through `joined_text` if given, encode as they do alone; None
    for none), as one text: chunk i owns the
    pre-tokenizer's next `pieces(chunk i)` words, each of which starts with `word_mark`, or without
    `pieces` (one word, no token spanning two chunks) the tokens that make up its bytes. With `runs`, a chunk is a
    run of spaces or "▁" and a word, and one that lacks either is encoded alone; with `even_runs` too, a joined
    chunk's run of even length is encoded as two spaces (see the docstring above)."""

    def __init__(self, name, split, alone=None, joined_pre_tokenizer=None, pieces=None, word_mark=None,
                 runs=False, even_runs=False, joined_text=None):
        self.name, self.split, self.alone = name, split, alone
        self.joined_pre_tokenizer, self.pieces, self.word_mark = joined_pre_tokenizer, pieces, word_mark
        self.joined_text = joined_text
        self.runs, self.even_runs = runs, even_runs


GPT2 = CutRule("GPT-2 byte-level", _GPT2_CHUNK_RE.findall)
SPLIT = CutRule("regex Split + ByteLevel", _SPLIT_CHUNK_RE.findall)


def _prepended(findall):
    """Metaspace chunks when the tokenizer prepends "▁" to a text that does not start with one: the first
    chunk gets it as a space, and is then cached like any other."""
    def split(text):
        chunks = findall(text)
        if chunks[0][0] not in " \u2581":
            chunks[0] = " " + chunks[0]
        return chunks
    return split


# Joined, no chunk that starts with a space gets a "▁" prepended, and `split` true cuts before every "▁" (a
# space, or one in the text): a chunk is that many words. Cutting there is exact (see above), so `split` true
# gives the same ids as false. With `prepend_scheme` "never" a first chunk without a space is encoded alone.
_JOINED = dict(joined_pre_tokenizer=lambda pre: dict(pre, split=True),
               pieces=lambda c: c.count(" ") + c.count("\u2581"), word_mark="\u2581")
METASPACE = CutRule("Metaspace", _prepended(_SPACE_CHUNK_RE.findall), **_JOINED)
METASPACE_NEVER = CutRule("Metaspace", _SPACE_CHUNK_RE.findall, lambda c: c[0] != " ", **_JOINED)
# A vocabulary with whitespace-run tokens: a chunk is a run of spaces or "▁" and what follows up to the next
# one. Joined, the chunks are one word given no "▁" (the first chunk's, if any, is in it), cut only where a
# "▁" follows another character, which no token spans (see above); a chunk that does not start with a space
# or ends with one (a document's last run) would not be cut so, and is encoded alone. That word goes to the
# model with its spaces written as "▁", without a pre-tokenizer: all Metaspace would do with `split` false and
# nothing prepended, and cheaper.
_RUN_CHUNK_RE = re.compile("[ \u2581]++[^ \u2581]*+|[^ \u2581]++")
_RUNS = dict(runs=True, joined_pre_tokenizer=lambda pre: None, joined_text=lambda text: text.replace(" ", "\u2581"))
METASPACE_RUNS = CutRule("Metaspace whitespace-run", _prepended(_RUN_CHUNK_RE.findall), **_RUNS)
METASPACE_RUNS_NEVER = CutRule("Metaspace whitespace-run", _RUN_CHUNK_RE.findall, **_RUNS)
# The same cuts, with the even runs of a chunk encoded as two spaces (see above).
_EVEN = dict(_RUNS, even_runs=True)
METASPACE_EVEN_RUNS = CutRule("Metaspace whitespace-run, even-run", _prepended(_RUN_CHUNK_RE.findall), **_EVEN)
METASPACE_EVEN_RUNS_NEVER = CutRule("Metaspace whitespace-run, even-run", _RUN_CHUNK_RE.findall, **_EVEN)


def _byte_level(pre, use_regex):
    return (pre.get("type") == "ByteLevel" and not pre.get("add_prefix_space")
            and bool(pre.get("use_regex", True)) == use_regex)


def _metaspace_rule(pre, model, vocab):
    """(the Metaspace CutRule for this BPE model, None) or (None, why no cut is proven); see the docstring."""
    mark = "\u2581"
    first = pre.get("prepend_scheme") in ("first", "always")
    if pre.get("replacement") != mark:
        return None, f"Metaspace with the replacement {pre.get('replacement')!r}"
    if pre.get("split", True):  # the pre-tokenizer itself cuts before every "▁"
        return (METASPACE if first else METASPACE_NEVER), None
    if model.get("type") != "BPE":
        return None, f"Metaspace with a {model.get('type')} model (the cuts are proven for BPE merges)"
    if model.get("ignore_merges"):
        return None, "Metaspace with ignore_merges (a whole document found in the vocabulary is one token)"
    if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        return None, "Metaspace with a BPE subword prefix or suffix (they mark the document's ends, not chunks')"
    if mark not in vocab or (model.get("unk_token") or "").endswith(mark):
        return None, "Metaspace whose '\u2581' is not a token of its own"
    pairs = [tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1)) for m in model.get("merges") or ()]
    made = ["".join(p) for p in pairs]
    crossing = next(filter(re.compile("[^\u2581]\u2581").search, made), None)
    if crossing is not None:
        return None, (f"Metaspace merges make {crossing!r}, with '\u2581' after another character (a merge may "
                      f"cross a space)")
    if any(mark in t[1:] for t in made):  # whitespace runs, possibly followed by a word
        if _even_runs_hold(pairs, made):
            return (METASPACE_EVEN_RUNS if first else METASPACE_EVEN_RUNS_NEVER), None
        return (METASPACE_RUNS if first else METASPACE_RUNS_NEVER), None
    return (METASPACE if first else METASPACE_NEVER), None


def _even_runs_hold(pairs, made):
    """Whether the merges allow the even-run encoding (see the docstring): ("▁", "▁") ranks below every other
    merge of two runs of "▁" or with "▁" on the left, and no merge makes "▁▁" followed by another character.
    Ranks as the tokenizer keeps them: a merge's place in the list, the last one where a pair repeats."""
    mark = "\u2581"
    if any(map(re.compile(mark + "{2,}[^" + mark + "]").match, made)):
        return False
    rank = {pair: i for i, pair in enumerate(pairs)}
    lowest = rank.get((mark, mark))
    return lowest is not None and all(
        i > lowest for (left, right), i in rank.items()
        if (left, right) != (mark, mark) and (left == mark or not (left + right).strip(mark)))


def cut_rule(config, vocab):
    """(the CutRule for this tokenizer.json config, None) or (None, why the cache would not be exact)."""
    pre = config.get("pre_tokenizer") or {}
    model = config.get("model") or {}
    if model.get("dropout"):
        return None, "BPE dropout makes encoding random"
    if _byte_level(pre, use_regex=True):
        return GPT2, None
    steps = pre.get("pretokenizers") if pre.get("type") == "Sequence" else None
    if steps and len(steps) == 2 and steps[0].get("type") == "Split" and _byte_level(steps[1], use_regex=False):
        split = steps[0]
        pattern = (split.get("pattern") or {}).get("Regex")
        if pattern in SPLIT_PATTERNS and split.get("behavior") == "Isolated" and not split.get("invert"):
            return SPLIT, None
        return None, "pre-tokenizer Split with a regex whose boundaries are not proven here"
    if pre.get("type") == "Metaspace":
        if config.get("normalizer") is not None:
            return None, "Metaspace after a normalizer (it may prepend or replace across chunks)"
        return _metaspace_rule(pre, model, vocab)
    return None, f"pre-tokenizer {pre.get('type')} (the cache knows GPT-2 ByteLevel, Llama-3-style Split, Metaspace)"
