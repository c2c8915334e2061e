"""The map from a dataset's documents back to their source: file and record number.

Stored beside the shards as `<prefix>.prov.npz` (compressed numpy arrays): the list of source files,
and per document the index of its file and its 1-based line (JSONL) or row (Parquet/Arrow).
Consecutive documents come from consecutive lines, so the arrays compress to a few bytes each.
"""
import os

import numpy as np


def provenance_path(prefix):
    return prefix + ".prov.npz"


def write_provenance(prefix, files, file_ids, lines):
    path = provenance_path(prefix)
    tmp = path + f".tmp{os.getpid()}.npz"
    np.savez_compressed(tmp, files=np.asarray(files, dtype=str),
                        file_id=np.asarray(file_ids, dtype=np.uint32),
                        line=np.asarray(lines, dtype=np.int64))
    os.replace(tmp, path)


class Provenance:
    """Document index -> (source file, record number) for one dataset prefix."""

    def __init__(self, prefix):
        path = provenance_path(prefix)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no provenance map {path!r}; it is written by "
                                    f"tools/preprocess_data.py (datasets from other tools lack it)")
        with np.load(path) as z:
            self.files = [str(f) for f in z["files"]]
            self.file_id = z["file_id"]
            self.line = z["line"]

    def __len__(self):
        return len(self.line)

    def lookup(self, doc):
        return self.files[int(self.file_id[doc])], int(self.line[doc])


def merge_provenance(prefixes, output_prefix):
    """Concatenate the maps of `prefixes` in order; returns False if any part lacks one."""
    if not all(os.path.isfile(provenance_path(p)) for p in prefixes):
        return False
    files, ids, lines = [], [], []
    for p in prefixes:
        prov = Provenance(p)
        remap = np.asarray([_intern(files, f) for f in prov.files] or [0], dtype=np.uint32)
        ids.append(remap[prov.file_id])
        lines.append(prov.line)
    write_provenance(output_prefix, files, np.concatenate(ids), np.concatenate(lines))
    return True


def _intern(table, item):
    if item not in table:
        table.append(item)
    return table.index(item)
