"""data.stages at training time: one blend per stage laid end to end (data/stages.py), and the validation
sets that follow the stage being trained.

Stage s trains steps [until_step of stage s-1, its own until_step); its blend is built for exactly the samples
those steps read within train.steps (a batch-size ramp counted, engine/batch_ramp.py). The first stage uses
train.seed, so a single stage is the same run as data.paths; later stages get their own seed, so a dataset
that appears in several stages is reshuffled for each stage rather than replaying the same order. Evaluation
after step k uses the validation split of the stage that trained step k (its blend, and with
train.eval_per_dataset each of its datasets).
"""
from __future__ import annotations

import os

import numpy as np

from data.stages import StagedDataset, parse_stages
from engine.batch_ramp import samples_after
from engine.config.schema import Config, ConfigError


def stage_seed(seed: int, stage: int) -> int:
    """train.seed for the first stage; an independent stream per later stage."""
    return seed if stage == 0 else int(np.random.SeedSequence([seed, stage]).generate_state(1)[0])


class DataStages:
    def __init__(self, cfg: Config):
        from data.loader import build_datasets
        from data.paths import parse_paths
        t, d = cfg.train, cfg.data
        stages = parse_stages(d.stages)
        self.until = [until for until, _ in stages]
        run_end = samples_after(t, t.steps)
        bounds = [samples_after(t, until) for until in self.until]
        valid = {"valid": t.eval_iters * t.global_batch_size} if t.eval_interval > 0 else {}
        self.splits, self.by_dataset, start = [], [], 0
        for s, ((_, paths), end) in enumerate(zip(stages, bounds)):
            where = f"data.stages[{s}].paths"
            try:
                sets = build_datasets(paths, cfg.model.seq_length, stage_seed(t.seed, s), split=d.split,
                                      num_samples={"train": min(end, run_end) - start, **valid},
                                      cache_dir=d.cache_dir or None)
                per_dataset = {}
                for _, prefix in parse_paths(paths) if t.eval_per_dataset else ():
                    name = os.path.basename(prefix)
                    name = name if name not in per_dataset else f"{name}#{len(per_dataset)}"
                    one = build_datasets([prefix], cfg.model.seq_length, t.seed, split=d.split, num_samples=valid,
                                         cache_dir=d.cache_dir or None)["valid"]
                    if one is None:
                        raise ValueError(f"data.split={d.split!r} leaves no validation documents in {prefix}; give "
                                         f"the valid split a larger share or set train.eval_per_dataset=false")
                    per_dataset[name] = {"train": None, "valid": one, "test": None}
            except (OSError, ValueError) as exc:  # missing or malformed shards: the message names the file
                raise ConfigError(f"{where}: {exc}") from exc
            if sets["train"] is None:
                raise ConfigError(f"{where}: data.split={d.split!r} leaves no training documents; give the train "
                                  f"split a share")
            self.splits.append(sets)
            self.by_dataset.append(per_dataset)
            start = end
        self.train = StagedDataset([sets["train"] for sets in self.splits], bounds)

    def stage_of_step(self, step: int) -> int:
        """The stage that trains optimizer step `step` (0-based)."""
        return next((s for s, until in enumerate(self.until) if step < until), len(self.until) - 1)

    def datasets(self, completed_steps: int) -> dict:
        """{"train": every stage end to end, "valid"/"test": those of the stage that trained the last
        completed step (the first stage before any step)}."""
        sets = self.splits[self.stage_of_step(max(completed_steps - 1, 0))]
        return {"train": self.train, "valid": sets["valid"], "test": sets["test"]}

    def validation_sets(self, completed_steps: int) -> dict:
        """train.eval_per_dataset: {dataset name: its validation split} of that same stage."""
        return self.by_dataset[self.stage_of_step(max(completed_steps - 1, 0))]

