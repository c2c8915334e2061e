"""Clean a raw corpus before tokenization: language filter, PII scrubbing, quality heuristics,
decontamination against evaluation sets and near-duplicate removal, with a map from every output
document back to its raw file and line.

    python tools/curate_data.py --input raw/ --output clean/corpus.jsonl --languages en,zh --workers 2

Reads what tools/preprocess_data.py reads (JSONL, .jsonl.zst, Parquet/Arrow; files, directories,
globs). Writes the kept documents as JSONL: each raw record's fields, its text cleaned, plus
`source_file` and `source_line` naming the raw file and line (a record that already carries them, from
an earlier pass, keeps them). preprocess_data stores those in its provenance map, so
data.loader.sample_provenance traces a training sample to the raw line. Every dropped document is in
the rejects file with its stage and reason; nothing is dropped silently. Outputs appear only when
complete. Deduplication needs the whole corpus: the documents that pass the other stages are held in a
pending file beside the output, their MinHash signatures in another (512 bytes each), and about 60 bytes
each in memory; once all are read, duplicates are found by sorting (data/offline/dedup.py) and the pending file
is written out without them.

On a cluster: N array tasks (`--num-shards N`, the task's index from `--shard-index` or
$SLURM_ARRAY_TASK_ID), then `--num-shards N --merge-shards`, which finds the duplicates across all tasks
and writes what one process writes, byte for byte; launch/run_data_job.sh submits both (data/offline/shards.py).
"""
import argparse
import collections
import functools
import json
import os
import shutil
import sys
import time
import unicodedata

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from data.offline import pii as pii_rules, quality as quality_rules  # noqa: E402
from data.offline.corpus_io import (JSONL_SUFFIXES, ORIGIN_FIELDS, CorpusError, RecordError,  # noqa: E402
                              add_input_arguments, expand_inputs, iter_records, parse_record, record_origin,
                              record_texts, refuse_overwriting, shard_ranges)
from data.offline.contamination import EvaluationIndex  # noqa: E402
from data.offline.dedup import (SHINGLE_UNITS, DuplicateFinder, ShardedSignatures, Signer, find_clusters,  # noqa: E402
                          lsh_bands)
from data.offline.workers import WorkerDied, batched, ordered_map  # noqa: E402
from data.offline.shards import (add_shard_arguments, all_markers, describe_inputs, finished, resolve_shard,  # noqa: E402
                           settings, shard_name, write_marker)

LANGID_CHARS = 4096  # the head of a document decides its language: langid's cost grows with length
REPORT_FIRST = 5     # unreadable records printed with file:line; all of them go to the rejects file

# group: the document's language when identified, else its script (quality.script), for the rule-share warnings.
Kept = collections.namedtuple("Kept", "origin output signature pii group", defaults=(None,))
Dropped = collections.namedtuple("Dropped", "origin stage reason detail duplicate_of group", defaults=(None, None))


@functools.lru_cache(maxsize=1)
def _language_identifier():
    from py3langid.langid import MODEL_FILE, LanguageIdentifier
    return LanguageIdentifier.from_model_file(MODEL_FILE, norm_probs=True)  # loads in ~0.7 s


# Varieties py3langid tells apart that a user asking for the language means too (--language-varieties):
# its "wuu" (Wu) and "yue" (Cantonese) fire on ordinary written Chinese, tables of numbers in particular.
VARIETIES = "zh=wuu,yue"


def parse_varieties(spec):
    """{variety: language} from "zh=wuu,yue;..." ("" for none)."""
    found = {}
    for item in filter(None, (part.strip() for part in spec.split(";"))):
        language, sep, varieties = item.partition("=")
        if not sep or not language.strip() or not varieties.strip():
            raise ValueError(f"--language-varieties: {item!r} is not LANGUAGE=VARIETY[,VARIETY...], e.g. {VARIETIES}")
        found.update({v.strip(): language.strip() for v in varieties.split(",") if v.strip()})
    return found


class LanguageFilter:
    """Keeps documents whose language (py3langid, normalised probabilities) is in `languages`, a variety in
    `varieties` ({variety: language}) counting as its language, with the probabilities of both added up.
    The document's head is NFKC-folded for the identification only (full-width digits and Latin letters,
    common in Chinese and Japanese text, otherwise read as another language's)."""

    def __init__(self, languages, min_confidence, varieties=None):
        self.identifier = _language_identifier()
        varieties = varieties or {}
        unknown = sorted((set(languages) | set(varieties) | set(varieties.values())) - set(self.identifier.labels))
        if unknown:
            raise ValueError(f"--languages/--language-varieties: unknown code(s) {', '.join(unknown)}; py3langid "
                             f"knows {', '.join(sorted(self.identifier.labels))}")
        self.languages, self.min_confidence = set(languages), min_confidence
        self.varieties = {v: lang for v, lang in varieties.items() if lang in self.languages}

    def identify(self, text):
        """(language, probability): a variety as its language."""
        head = unicodedata.normalize("NFKC", text[:LANGID_CHARS])
        language, probability = self.identifier.classify(head)
        counted = self.varieties.get(language, language)
        if counted in self.languages and any(lang == counted for lang in self.varieties.values()):
            group = {counted} | {v for v, lang in self.varieties.items() if lang == counted}
            probability = sum(p for lang, p in self.identifier.rank(head) if lang in group)
        return counted, probability

    def check(self, text):
        """(None or (reason, detail), the language identified)."""
        language, probability = self.identify(text)
        if language not in self.languages:
            return (f"language:{language}", f"detected {language} (p={probability:.2f})"), language
        if probability < self.min_confidence:
            return ("low_language_confidence", f"{language} with p={probability:.2f} < {self.min_confidence}"), language
        return None, language


class Stages:
    """The per-document stages, built once and shipped to each worker process."""

    def __init__(self, files, keys, language=None, pii=True, rules=None, signer=None, evaluation=None):
        self.files, self.keys = files, keys
        self.language, self.pii, self.rules, self.signer = language, pii, rules, signer
        self.evaluation = evaluation  # data.offline.contamination.EvaluationIndex, or None

    def clean(self, file_index, line, payload):
        """Kept (the output line, the MinHash signature for deduplication) or Dropped."""
        origin = (self.files[file_index], line)
        try:
            record = parse_record(payload)
            texts = record_texts(record, self.keys)
        except RecordError as e:
            return Dropped(origin, "input", e.reason, str(e))
        origin = record_origin(record) or origin
        group = None
        if self.language is not None:
            verdict, group = self.language.check("\n\n".join(texts))
            if verdict:
                return Dropped(origin, "language", *verdict, group=group)
        raw = "\n\n".join(texts)  # evaluation texts are compared before PII scrubbing changes anything
        replaced = collections.Counter()
        if self.pii:
            for i, text in enumerate(texts):
                texts[i], counts = pii_rules.scrub(text)
                replaced.update(counts)
        text = "\n\n".join(texts)
        if self.rules is not None:
            text_script = quality_rules.script(text, self.rules)
            group = group or f"{text_script}-script"
            verdict = quality_rules.check(text, self.rules, text_script)
            if verdict:
                return Dropped(origin, "quality", *verdict, group=group)
        if self.evaluation is not None:
            verdict = self.evaluation.check(raw)
            if verdict:
                return Dropped(origin, "decontamination", *verdict, group=group)
        record.update(zip(self.keys, texts))
        record.update(zip(ORIGIN_FIELDS, origin))
        # default=str: Parquet/Arrow columns may hold dates or decimals, which JSON has no type for.
        output = json.dumps(record, ensure_ascii=False, default=str)
        return Kept(origin, output, self.signer(text) if self.signer else None, replaced, group)


_worker = {}


def _init_worker(stages):
    _worker["stages"] = stages


def _clean_task(records):
    """The per-document stages over one batch. Signatures are computed here, in parallel; the
    duplicate finder stays in the main process, which sees documents in corpus order."""
    stages = _worker["stages"]
    nbytes = sum(len(payload) for _, _, payload in records if isinstance(payload, bytes))
    return [stages.clean(*record) for record in records], nbytes


def default_rejects_path(output):
    stem, ext = os.path.splitext(output)
    return f"{stem}.rejects{ext}"


def curate(args, files, stages, finder, start):
    """Stream `files` through the stages into args.output and the rejects file, the duplicate finder (None:
    no deduplication) deciding last; returns the summary (`start`: when the run began)."""
    dropped, pii = collections.Counter(), collections.Counter()
    counts = collections.Counter()
    out_tmp, rejects_tmp = args.output + ".tmp", args.rejects + ".tmp"
    pending = args.output + ".pending"  # documents that passed the stages, until duplicates are known
    try:
        with open(rejects_tmp, "w", encoding="utf-8") as rejects:
            with open(pending if finder is not None else out_tmp, "w", encoding="utf-8") as out:
                _run_stages(args, files, stages, finder, out, rejects, dropped, pii, counts)
            if finder is not None:
                if not args.quiet:
                    print(f"curate: finding duplicates among {len(finder):,} documents ({finder.bands} LSH "
                          f"bands of {finder.rows} rows)", file=sys.stderr)
                _remove_duplicates(finder.find(), [pending], out_tmp, rejects, dropped, pii, counts, args.quiet)
        os.replace(rejects_tmp, args.rejects)
        os.replace(out_tmp, args.output)  # last: an output file means a finished run
    except BaseException:
        for tmp in (out_tmp, rejects_tmp):
            if os.path.exists(tmp):
                os.remove(tmp)
        raise
    finally:
        if finder is not None:
            finder.close()
        if os.path.exists(pending):
            os.remove(pending)
    return _summary(args, counts, dropped, pii, start)


def _run_stages(args, files, stages, finder, out, rejects, dropped, pii, counts, ranges=None, pend=False):
    """The per-document stages over `files` (one task's `ranges` of them), in corpus order: rejects to
    `rejects`; kept documents to `out`, as pending lines (origin and PII counts, a tab, the output) when
    duplicates are still to be found (a finder, or `pend` for an array task without deduplication)."""
    last_report = time.time()
    records = iter_records(files, args.json_keys, all_fields=True, max_record_bytes=args.max_record_bytes,
                           ranges=ranges)
    for results, nbytes in ordered_map(_clean_task, batched(records, args.batch_size), args.workers,
                                       _init_worker, (stages,)):
        counts["bytes"] += nbytes
        for result in results:
            counts["documents"] += 1
            if result.group is not None:  # per language (or script): its documents, and those each rule drops
                counts[f"group:{result.group}"] += 1
                if isinstance(result, Dropped) and result.stage == "quality":
                    counts[f"rule:{result.group}:{result.reason}"] += 1
            if isinstance(result, Dropped):
                _write_reject(rejects, result, dropped, args.quiet)
            elif finder is None and not pend:
                out.write(result.output + "\n")
                pii.update(result.pii)
                counts["kept"] += 1
            else:
                if finder is not None:
                    finder.add(*result.signature)
                # JSON output never holds a raw tab: the origin and PII counts go before one.
                out.write(json.dumps([result.origin, result.pii], ensure_ascii=False) + "\t" + result.output + "\n")
                counts["pending"] += 1
        if not args.quiet and time.time() - last_report > 10:
            last_report = time.time()
            print(f"curate: {counts['documents']:,} documents read", file=sys.stderr)


def _summary(args, counts, dropped, pii, start):
    by_stage = collections.defaultdict(dict)
    for (stage, reason), n in sorted(dropped.items(), key=lambda item: -item[1]):
        by_stage[stage][reason] = n
    return {"documents_in": counts["documents"], "kept": counts["kept"],
            "dropped": sum(dropped.values()), "dropped_by_stage": dict(by_stage),
            "pii_replaced": {kind: pii[kind] for kind in pii_rules.PLACEHOLDERS},
            "duplicates_removed": sum(by_stage.get("dedup", {}).values()),
            "input_bytes": counts["bytes"], "seconds": time.time() - start,
            "output": args.output, "rejects": args.rejects,
            "rule_warnings": rule_warnings(counts, args.warn_rule_share), "warn_rule_share": args.warn_rule_share}


def rule_warnings(counts, share):
    """[(rule, group, dropped, documents)] where one quality rule dropped more than `share` of a language's
    (or, without language identification, a script's) documents."""
    found = []
    for key, n in sorted(counts.items()):
        if key.startswith("rule:"):
            group, rule = key[len("rule:"):].rsplit(":", 1)
            total = counts[f"group:{group}"]
            if n > share * total:
                found.append((rule, group, n, total))
    return sorted(found, key=lambda w: -w[2] / w[3])


def shard_dir(args, index):
    return os.path.join(args.output + ".shards", shard_name(index, args.num_shards))


def curate_shard(args, files, stages, finder):
    """One array task: the stages over its part of the corpus, into its directory beside the output (pending
    documents, rejects, MinHash digests, band keys and signatures), then its done-marker. Returns False when
    an earlier run already finished this task on the same bytes and settings."""
    directory = shard_dir(args, args.shard_index)
    ranges = shard_ranges(files, args.shard_index, args.num_shards)
    inputs, options = describe_inputs(files, ranges), settings(args)
    marker_path = os.path.join(directory, "done.json")
    if finished(marker_path, inputs, options):
        return False
    os.makedirs(directory, exist_ok=True)
    if os.path.exists(marker_path):
        os.remove(marker_path)
    dropped, pii, counts = collections.Counter(), collections.Counter(), collections.Counter()
    with open(os.path.join(directory, "rejects.jsonl"), "w", encoding="utf-8") as rejects, \
            open(os.path.join(directory, "pending.jsonl"), "w", encoding="utf-8") as out:
        _run_stages(args, files, stages, finder, out, rejects, dropped, pii, counts, ranges, pend=True)
    if finder is not None:
        finder.save(directory)
    write_marker(marker_path, {"inputs": inputs, "settings": options, "counts": dict(counts),
                               "dropped": [[stage, reason, n] for (stage, reason), n in dropped.items()]})
    return True


def merge_shards(args, files, stages, start):
    """The merge after all array tasks: their rejects in order, then duplicates found across all of them and
    the pending documents written out without them, exactly as one process would."""
    directories = [shard_dir(args, i) for i in range(args.num_shards)]
    markers = all_markers([os.path.join(d, "done.json") for d in directories], files, settings(args))
    dropped, pii, counts = collections.Counter(), collections.Counter(), collections.Counter()
    for marker in markers:
        counts.update(marker["counts"])
        dropped.update({(stage, reason): n for stage, reason, n in marker["dropped"]})
    out_tmp, rejects_tmp = args.output + ".tmp", args.rejects + ".tmp"
    pending = [os.path.join(d, "pending.jsonl") for d in directories]
    try:
        with open(rejects_tmp, "w", encoding="utf-8") as rejects:
            for d in directories:
                with open(os.path.join(d, "rejects.jsonl"), encoding="utf-8") as part:
                    shutil.copyfileobj(part, rejects)
            if stages.signer is not None:
                bands, _ = lsh_bands(args.dedup_threshold, args.num_perm)
                corpus = ShardedSignatures(directories, args.num_perm, bands)
                found = find_clusters(corpus.digests, corpus.band_keys(), corpus, args.dedup_threshold)
            else:
                n = counts["pending"]
                found = np.arange(n), np.ones(n, np.float32), np.ones(n, bool)
            _remove_duplicates(found, pending, out_tmp, rejects, dropped, pii, counts, args.quiet)
        os.replace(rejects_tmp, args.rejects)
        os.replace(out_tmp, args.output)
    except BaseException:
        for tmp in (out_tmp, rejects_tmp):
            if os.path.exists(tmp):
                os.remove(tmp)
        raise
    shutil.rmtree(args.output + ".shards")
    return _summary(args, counts, dropped, pii, start)


def _remove_duplicates(found, pending, out_path, rejects, dropped, pii, counts, quiet):
    """Copy the pending documents (the lines of the `pending` files, in order) to `out_path` without the
    duplicates `found` (root, similarity, exact); each duplicate's reject names the kept document of its
    cluster."""
    root, similarity, exact = found
    kept_origins = {}  # origins of the kept documents that others duplicate; each comes before its copies
    needed = set(np.unique(root[root != np.arange(len(root))]).tolist())
    with open(out_path, "w", encoding="utf-8") as out:
        for i, line in enumerate(line for path in pending for line in open(path, encoding="utf-8")):
            head, output = line.split("\t", 1)
            origin, replaced = json.loads(head)
            keeper = int(root[i])
            if keeper == i:
                out.write(output)
                pii.update(replaced)
                counts["kept"] += 1
                if i in needed:
                    kept_origins[i] = origin
                continue
            source, source_line = kept_origins[keeper]
            if exact[i]:
                reason, detail = "exact_duplicate", f"identical to {source}:{source_line}"
            else:
                reason, detail = "near_duplicate", f"estimated Jaccard {similarity[i]:.2f} with {source}:{source_line}"
            _write_reject(rejects, Dropped(tuple(origin), "dedup", reason, detail,
                                           {"source_file": source, "source_line": source_line}), dropped, quiet)


def _write_reject(rejects, result, dropped, quiet):
    source, line = result.origin
    if result.stage == "input" and not quiet and sum(
            n for (stage, _), n in dropped.items() if stage == "input") < REPORT_FIRST:
        print(f"curate: skipping {source}:{line}: {result.reason}: {result.detail}", file=sys.stderr)
    dropped[result.stage, result.reason] += 1
    entry = {"source_file": source, "source_line": line, "stage": result.stage, "reason": result.reason,
             "detail": result.detail}
    if result.duplicate_of:
        entry["duplicate_of"] = result.duplicate_of
    rejects.write(json.dumps(entry, ensure_ascii=False) + "\n")


def format_summary(summary, stages):
    n, kept, seconds = summary["documents_in"], summary["kept"], summary["seconds"]
    lines = [f"curate: {n:,} documents in, {kept:,} kept ({kept / max(n, 1):.1%}), {summary['dropped']:,} "
             f"dropped in {seconds:.1f} s ({summary['input_bytes'] / 1e6 / max(seconds, 1e-9):.1f} MB/s)",
             "  dropped by stage and reason:"]
    enabled = {"input": True, "language": stages.language is not None, "quality": stages.rules is not None,
               "decontamination": stages.evaluation is not None, "dedup": stages.signer is not None}
    for stage in enabled:  # PII scrubbing replaces, it never drops
        reasons = summary["dropped_by_stage"].get(stage, {})
        detail = ", ".join(f"{reason} {count:,}" for reason, count in reasons.items())
        count = f"{sum(reasons.values()):,}" if enabled[stage] else "-"
        lines.append(f"    {stage:<15}{count:>7}  {detail if enabled[stage] else 'off'}".rstrip())
    dedup = summary["dropped_by_stage"].get("dedup", {})
    lines.append(f"  duplicates removed: {summary['duplicates_removed']:,} "
                 f"({dedup.get('exact_duplicate', 0):,} exact, {dedup.get('near_duplicate', 0):,} near)")
    pii = summary["pii_replaced"]
    lines.append("  PII replaced in kept documents: "
                 + (", ".join(f"{kind} {pii[kind]:,}" for kind in pii) if stages.pii else "off"))
    lines.append(f"  wrote {summary['output']}; rejects: {summary['rejects']}")
    for rule, group, n, total in summary["rule_warnings"]:
        lines.append(f"  warning: the quality rule {rule} dropped {n:,} of {total:,} {group} documents "
                     f"({n / total:.1%} > --warn-rule-share {summary['warn_rule_share']:.0%}); read their "
                     f"rejects and loosen that rule if they are text to keep")
    return "\n".join(lines)


def build_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("input and output")
    add_input_arguments(g, "keys to clean (default: text)")
    g.add_argument("--output", required=True, help="JSONL file of the kept documents")
    g.add_argument("--rejects", help="JSONL file of the dropped ones (default: <output>.rejects.jsonl)")
    g = p.add_argument_group("language identification (py3langid)")
    g.add_argument("--languages", help="comma-separated ISO 639-1 codes to keep, e.g. en,zh (default: all)")
    g.add_argument("--min-language-confidence", type=float, default=0.0,
                   help="drop documents whose language probability is lower (default: 0)")
    g.add_argument("--language-varieties", default=VARIETIES,
                   help="varieties counted as a listed language, LANGUAGE=VARIETY,...;... ('' for none; "
                        "default: %(default)s)")
    g = p.add_argument_group("PII scrubbing")
    g.add_argument("--no-pii", action="store_true", help="keep e-mails, phone and ID numbers as they are")
    g = p.add_argument_group("quality heuristics")
    defaults = quality_rules.QualityRules()
    g.add_argument("--no-quality", action="store_true", help="skip the quality heuristics")
    g.add_argument("--min-chars", type=int, default=defaults.min_chars,
                   help="characters, surrounding space excluded (default: %(default)s)")
    g.add_argument("--min-words", type=int, default=defaults.min_words,
                   help="words; a CJK character is a word (default: %(default)s)")
    g.add_argument("--max-symbol-ratio", type=float, default=defaults.max_symbol_ratio,
                   help="of non-space characters that are not letters, digits or _ (default: %(default)s)")
    g.add_argument("--max-duplicate-line-fraction", type=float, default=defaults.max_duplicate_line_fraction,
                   help="of non-blank lines that repeat an earlier line (default: %(default)s)")
    g.add_argument("--max-boilerplate-fraction", type=float, default=defaults.max_boilerplate_fraction,
                   help="of non-blank lines holding a boilerplate phrase (default: %(default)s)")
    g.add_argument("--boilerplate-file", help="more boilerplate phrases, one a line")
    g.add_argument("--min-mean-word-length", type=float, default=defaults.min_mean_word_length,
                   help="over words outside CJK scripts (default: %(default)s)")
    g.add_argument("--max-mean-word-length", type=float, default=defaults.max_mean_word_length,
                   help="(default: %(default)s)")
    g.add_argument("--cjk-share", type=float, default=defaults.cjk_share,
                   help="share of a document's letters that are CJK characters from which the CJK rules apply "
                        "instead of --min-chars and the word-length rule (default: %(default)s)")
    g.add_argument("--cjk-min-chars", type=int, default=defaults.cjk_min_chars,
                   help="characters of a CJK document (default: %(default)s)")
    g.add_argument("--cjk-max-top-char-share", type=float, default=defaults.cjk_max_top_char_share,
                   help="of a CJK document's CJK characters that are its most frequent one, for documents of at "
                        f"least {defaults.cjk_repetition_min_chars} (default: %(default)s)")
    g.add_argument("--warn-rule-share", type=float, default=0.05,
                   help="warn when one quality rule drops more than this share of a language's documents "
                        "(default: %(default)s)")
    g = p.add_argument_group("decontamination (evaluation and validation sets)")
    g.add_argument("--decontaminate", nargs="+", metavar="EVAL",
                   help="evaluation sets (same formats as --input): training documents sharing text with them "
                        "are dropped")
    g.add_argument("--decontaminate-keys", nargs="+", default=["text"],
                   help="keys of the evaluation records to compare, joined (default: text)")
    g.add_argument("--decontaminate-ngram", type=int, default=13,
                   help="words per n-gram (default: %(default)s, as GPT-3)")
    g.add_argument("--decontaminate-min-hits", type=int, default=1,
                   help="shared n-grams that make a document contaminated (default: %(default)s)")
    g = p.add_argument_group("near-duplicate removal (MinHash + LSH)")
    g.add_argument("--no-dedup", action="store_true", help="keep duplicates")
    g.add_argument("--dedup-threshold", type=float, default=0.8,
                   help="estimated Jaccard similarity from which a later document is a duplicate "
                        "(default: %(default)s)")
    g.add_argument("--num-perm", type=int, default=128, help="MinHash permutations (default: %(default)s)")
    g.add_argument("--shingle-size", type=int, default=5, help="n of the n-gram shingles (default: %(default)s)")
    g.add_argument("--shingle-unit", choices=SHINGLE_UNITS, default="word",
                   help="words (CJK characters count as words) or characters (default: %(default)s)")
    g.add_argument("--dedup-workdir", help="where the signatures file goes, 512 bytes per document with 128 "
                                           "permutations (default: the output's directory)")
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=1, help="worker processes")
    g.add_argument("--batch-size", type=int, default=64, help="documents per worker task")
    g.add_argument("--quiet", action="store_true", help="no progress or skipped-record lines")
    g = p.add_argument_group("array jobs (data/offline/shards.py; launch/run_data_job.sh submits them)")
    add_shard_arguments(g)
    return p


def build_stages(args, files):
    language = None
    if args.languages:
        language = LanguageFilter([c.strip() for c in args.languages.split(",") if c.strip()],
                                  args.min_language_confidence, parse_varieties(args.language_varieties))
    rules = None
    if not args.no_quality:
        extra = quality_rules.load_boilerplate(args.boilerplate_file) if args.boilerplate_file else ()
        rules = quality_rules.QualityRules(
            min_chars=args.min_chars, min_words=args.min_words, max_symbol_ratio=args.max_symbol_ratio,
            max_duplicate_line_fraction=args.max_duplicate_line_fraction,
            max_boilerplate_fraction=args.max_boilerplate_fraction,
            min_mean_word_length=args.min_mean_word_length, max_mean_word_length=args.max_mean_word_length,
            boilerplate=quality_rules.BOILERPLATE + extra, cjk_share=args.cjk_share, cjk_min_chars=args.cjk_min_chars,
            cjk_max_top_char_share=args.cjk_max_top_char_share)
    signer = None if args.no_dedup else Signer(args.num_perm, args.shingle_size, args.shingle_unit)
    evaluation = None
    if args.decontaminate:
        evaluation = EvaluationIndex(expand_inputs(args.decontaminate), args.decontaminate_keys,
                                     args.decontaminate_ngram, args.decontaminate_min_hits)
    return Stages(files, args.json_keys, language, not args.no_pii, rules, signer, evaluation)


def main(argv=None):
    start = time.time()
    p = build_parser()
    args = p.parse_args(argv)
    if min(args.workers, args.batch_size, args.shingle_size, args.max_record_bytes) < 1:
        p.error("--workers, --batch-size, --shingle-size and --max-record-bytes must be at least 1")
    if not 0 < args.dedup_threshold <= 1:
        p.error("--dedup-threshold must be in (0, 1]")
    if not args.output.endswith(JSONL_SUFFIXES):
        p.error(f"--output {args.output!r} should end with {', '.join(JSONL_SUFFIXES)}")
    resolve_shard(args, p)
    args.rejects = args.rejects or default_rejects_path(args.output)
    task = args.num_shards is not None and not args.merge_shards
    try:
        files = expand_inputs(args.input)
        stages = build_stages(args, files)
        workdir = shard_dir(args, args.shard_index) if task else (
            args.dedup_workdir or os.path.dirname(os.path.abspath(args.output)))
        finder = None if args.no_dedup or args.merge_shards else DuplicateFinder(
            args.dedup_threshold, args.num_perm, workdir)
    except ImportError as e:
        p.error(f"{e}: install the curate extra (pip install -e '.[curate]')")
    except (ValueError, OSError, CorpusError) as e:
        p.error(str(e))
    evaluation_files = expand_inputs(args.decontaminate) if args.decontaminate else []
    try:
        refuse_overwriting([args.output, args.rejects], files + evaluation_files)
    except ValueError as e:
        p.error(str(e))
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.rejects)), exist_ok=True)
    try:
        if task:
            return _run_task(args, files, stages, finder, start)
        summary = (merge_shards(args, files, stages, start) if args.merge_shards
                   else curate(args, files, stages, finder, start))
    except (CorpusError, WorkerDied, ValueError) as e:
        raise SystemExit(f"curate: {e}")
    print(format_summary(summary, stages))
    return summary


def _run_task(args, files, stages, finder, start):
    name = shard_name(args.shard_index, args.num_shards)
    try:
        ran = curate_shard(args, files, stages, finder)
    finally:
        if finder is not None:
            finder.close()
    print(f"curate: {name} " + (f"done in {time.time() - start:.1f} s" if ran else
                                "already done on the same inputs and settings; skipped"))
    return ran


if __name__ == "__main__":
    main()
