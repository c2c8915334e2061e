"""Running an offline corpus tool as an array of tasks (SLURM array jobs, or plain processes) plus a merge.

Task i of N reads `shard_ranges(files, i, N)` (data/offline/corpus_io.py) and writes its results beside the
output, then a done-marker: JSON naming every byte range it read with that range's size and BLAKE2b hash,
and the settings that shape the output. A task whose marker matches its inputs and settings exits at once,
so resubmitting the whole array after a failure or preemption reruns only the unfinished tasks. The merge
step refuses to start until every marker is there and still matches the input sizes.

    --num-shards N --shard-index I      one task (the index defaults to $SLURM_ARRAY_TASK_ID)
    --num-shards N --merge-shards       the merge, after all tasks
"""
import hashlib
import json
import os

# Options that change how fast a tool runs, never what it writes: a marker does not record them.
RUNTIME_OPTIONS = {"workers", "batch_size", "quiet", "shard_index", "merge_shards", "log_interval", "no_cache",
                   "no_fast_engine", "keep_partitions"}


def add_shard_arguments(group):
    group.add_argument("--num-shards", type=int, default=None,
                       help="run as one of N array tasks over the input bytes, then --merge-shards")
    group.add_argument("--shard-index", type=int, default=None,
                       help="this task's number, 0..N-1 (default: $SLURM_ARRAY_TASK_ID)")
    group.add_argument("--merge-shards", action="store_true",
                       help="combine the outputs of the --num-shards tasks into the single-process result")


def resolve_shard(args, parser):
    """Check the shard options; sets args.shard_index from SLURM when the task runs in an array job."""
    if args.num_shards is None:
        if args.shard_index is not None or args.merge_shards:
            parser.error("--shard-index and --merge-shards need --num-shards N")
        return
    if args.num_shards < 1:
        parser.error("--num-shards must be at least 1")
    if args.merge_shards:
        if args.shard_index is not None:
            parser.error("--merge-shards combines all tasks: drop --shard-index")
        return
    if args.shard_index is None:
        task = os.environ.get("SLURM_ARRAY_TASK_ID")
        if task is None:
            parser.error("--num-shards needs --shard-index I (or $SLURM_ARRAY_TASK_ID in an array job), "
                         "or --merge-shards")
        args.shard_index = int(task) - int(os.environ.get("SLURM_ARRAY_TASK_MIN", "0"))
    if not 0 <= args.shard_index < args.num_shards:
        parser.error(f"--shard-index {args.shard_index} is outside 0..{args.num_shards - 1} (--num-shards "
                     f"{args.num_shards}); submit the array as --array=0-{args.num_shards - 1}")


def shard_name(index, count):
    return f"shard-{index:05d}-of-{count:05d}"


def settings(args):
    """The options that decide a tool's output, as JSON-able values."""
    return {k: v for k, v in sorted(vars(args).items()) if k not in RUNTIME_OPTIONS}


def describe_inputs(files, ranges, digest=True):
    """[path, first byte, end byte, size, hash] per range read; the hash covers exactly the bytes read."""
    described = []
    for file_index, start, end in ranges:
        path = files[file_index]
        size = os.path.getsize(path)
        stop = size if end is None else end
        described.append([path, start, stop, size, _hash(path, start, stop) if digest else None])
    return described


def _hash(path, start, stop):
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        f.seek(start)
        left = stop - start
        while left:
            block = f.read(min(left, 1 << 24))
            if not block:
                break
            h.update(block)
            left -= len(block)
    return h.hexdigest()


def read_marker(path):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def write_marker(path, marker):
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(marker, f, indent=1)
    os.replace(tmp, path)  # last: a marker means every file of the task is complete


def finished(marker_path, inputs, options):
    """The marker of an earlier run of this task over the same bytes with the same settings, or None."""
    marker = read_marker(marker_path)
    if marker and marker.get("inputs") == inputs and marker.get("settings") == options:
        return marker
    return None


def all_markers(marker_paths, files, options):
    """Every task's marker, checked against the current input sizes and settings; ValueError naming the
    tasks to (re)run otherwise."""
    sizes = {path: os.path.getsize(path) for path in files}
    markers, missing, stale = [], [], []
    for i, path in enumerate(marker_paths):
        marker = read_marker(path)
        if marker is None:
            missing.append(i)
        elif marker.get("settings") != options or any(sizes.get(p) != size for p, _, _, size, _ in marker["inputs"]):
            stale.append(i)
        markers.append(marker)
    if missing or stale:
        parts = ([f"task(s) {_ranges(missing)} not finished"] if missing else []) + \
                ([f"task(s) {_ranges(stale)} ran on other inputs or settings"] if stale else [])
        raise ValueError(f"cannot merge: {'; '.join(parts)} (markers: {os.path.dirname(marker_paths[0])}); "
                         f"resubmit the array job (finished tasks are skipped), then merge")
    return markers


def _ranges(indices):
    return ",".join(map(str, indices))
