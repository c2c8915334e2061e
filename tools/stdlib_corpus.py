"""Write the embedded default corpus: every .py file of the running Python's standard library.

This is the corpus `make demo` trains on: it exists on every machine that runs Trilith, needs no
download, and is large enough (tens of MB) to exercise the tokenizer and preprocessing paths.
One JSON object per line, {"text": ..., "path": ...}, in sorted path order so that two runs on the
same Python produce the same file.
"""
import argparse
import json
import os
import sys
import sysconfig


def stdlib_python_files(root=None):
    """Sorted paths (relative to the stdlib root) of the stdlib's .py files, site-packages excluded."""
    root = root or sysconfig.get_paths()["stdlib"]
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Third-party packages are not the standard library and differ between machines.
        dirnames[:] = [d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__")]
        for name in filenames:
            if name.endswith(".py"):
                found.append(os.path.relpath(os.path.join(dirpath, name), root))
    return root, sorted(found)


def write_corpus(output, limit=None):
    root, files = stdlib_python_files()
    if limit is not None:
        files = files[:limit]
    tmp = output + ".tmp"
    written = skipped = 0
    with open(tmp, "w", encoding="utf-8") as out:
        for rel in files:
            try:
                with open(os.path.join(root, rel), encoding="utf-8") as f:
                    text = f.read()
            except (UnicodeDecodeError, OSError):
                # A handful of stdlib test files are deliberately not UTF-8; they are not text to learn.
                skipped += 1
                continue
            out.write(json.dumps({"text": text, "path": rel}, ensure_ascii=False) + "\n")
            written += 1
    os.replace(tmp, output)
    return root, written, skipped


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output", required=True, help="JSONL file to write")
    p.add_argument("--limit", type=int, default=None, help="keep only the first N files (sorted order)")
    args = p.parse_args(argv)
    if args.limit is not None and args.limit <= 0:
        p.error(f"--limit must be positive, got {args.limit}")
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    root, written, skipped = write_corpus(args.output, args.limit)
    size = os.path.getsize(args.output)
    print(f"stdlib corpus: {written} files from {root} ({skipped} non-UTF-8 skipped), "
          f"{size / 1e6:.1f} MB -> {args.output}", file=sys.stderr)


if __name__ == "__main__":
    main()
