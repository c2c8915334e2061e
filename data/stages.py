"""Data-mixture stages: the training stream switches from one blend to the next at step boundaries.

Stage s covers the global samples [start_s, end_s) (the samples its steps consume, told by the caller, so a
batch-size ramp is accounted for). Global sample i of stage s is sample i - start_s of that stage's own
dataset, so each stage reads its blend from the beginning, in order, exactly once per epoch of that blend,
and where a run resumes depends only on the samples consumed, like a single blend.
"""
import bisect

from data.paths import parse_paths


def parse_stages(stages):
    """[(until_step, paths)] from data.stages ([{until_step: N, paths: [...]}, ...]); ValueError naming the
    stage and the fix when one is malformed. Weights inside `paths` are checked where they are parsed."""
    out = []
    for i, stage in enumerate(stages):
        where = f"data.stages[{i}]"
        if not isinstance(stage, dict) or set(stage) != {"until_step", "paths"}:
            raise ValueError(f"{where} must be a mapping with exactly the keys until_step and paths, e.g. "
                             f"{{until_step: 900, paths: [\"0.7\", /data/web, \"0.3\", /data/code]}}")
        until, paths = stage["until_step"], stage["paths"]
        if isinstance(until, bool) or not isinstance(until, int) or not 1 <= until < 2**63:
            raise ValueError(f"{where}.until_step={until!r} must be a positive whole number of steps")
        if out and until <= out[-1][0]:
            raise ValueError(f"{where}.until_step={until} must be greater than the previous stage's "
                             f"{out[-1][0]}: stages are listed in training order")
        if isinstance(paths, str):
            paths = [paths]
        if (not isinstance(paths, list) or not paths
                or not all(isinstance(p, (str, int, float)) and not isinstance(p, bool) for p in paths)):
            raise ValueError(f"{where}.paths must be a non-empty list of dataset prefixes, optionally weighted "
                             f"like data.paths")
        out.append((until, [str(p) for p in paths]))
    return out


def stages_problem(stages, paths, mock, steps):
    """One line naming what is wrong with data.stages for a run of `steps` steps, or None."""
    if not stages:
        return None
    try:
        parsed = parse_stages(stages)
        for s, (_, stage_paths) in enumerate(parsed):
            try:
                parse_paths(stage_paths)
            except ValueError as exc:
                return f"data.stages[{s}].paths: {exc}"
    except ValueError as exc:
        return str(exc)
    if paths or mock:
        return ("data.stages gives each stage its own paths: leave data.paths empty and data.mock false "
                "when data.stages is set")
    if parsed[-1][0] < steps:
        return (f"data.stages ends at step {parsed[-1][0]} (the last until_step) but train.steps={steps}; "
                f"the last stage's until_step must be ≥ train.steps")
    if len(parsed) > 1 and parsed[-2][0] >= steps:
        return (f"data.stages[{len(parsed) - 1}] starts at step {parsed[-2][0]}, at or after train.steps={steps}, "
                f"so it would never train; remove it or raise train.steps")
    return None


class StagedDataset:
    """Stage datasets laid end to end: `bounds` are the global sample where each stage ends (increasing);
    stage s's dataset is read from its start at bounds[s - 1] (0 for the first) and wraps round its epochs."""

    def __init__(self, datasets, bounds):
        if len(datasets) != len(bounds) or any(b <= a for a, b in zip([0] + list(bounds), bounds)):
            raise ValueError(f"stage bounds {list(bounds)} must increase, one per stage dataset")
        self.datasets, self.bounds = list(datasets), list(bounds)

    def __len__(self):
        return self.bounds[-1]

    def stage_of(self, i):
        """The stage that global sample `i` belongs to (the last one for samples past the end)."""
        return min(bisect.bisect_right(self.bounds, i), len(self.bounds) - 1)

    def locate(self, i):
        """(stage dataset, sample index within it) of global sample `i`."""
        if i < 0:
            raise IndexError(f"sample {i} is negative")
        s = self.stage_of(i)
        ds = self.datasets[s]
        return ds, (i - (self.bounds[s - 1] if s else 0)) % len(ds)

    def __getitem__(self, i):
        ds, j = self.locate(i)
        return ds[j]

    def get_with_boundaries(self, i):
        ds, j = self.locate(i)
        return ds.get_with_boundaries(j)
