"""torchrun's stderr, for launch/lib/local_ranks.sh: the ranks' own lines pass to the console (each distinct
`trilith:` line once, not once per rank); torchrun's own log lines and its ChildFailedError report go to
run.dir/logs/torchrun.log, and one line for the launcher's last, the reason the run failed, to REASON_FILE.

    python launch/lib/torchrun_report.py REASON_FILE [--config FILE section.key=value ...] < torchrun's stderr

The reason is the root cause torchrun names when a signal killed a rank (`rank 1 on node3 was killed by
Signal 9 (SIGKILL)`), else the ranks' first `trilith:` line, else the root cause's exit code.
Standard library only until there is a report to keep: run.dir comes from the configuration then.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

TORCH_LOG = re.compile(r"^[EWI]\d{4} \d\d:\d\d:\d\d\.\d+ \d+ \S*torch/distributed/")
FIELD = re.compile(r"^\s+(rank|host|exitcode|traceback)\s*: (.*)$")


def root_cause(report: list[str]) -> str:
    """One line from the 'Root Cause' block of torchrun's report."""
    fields, seen = {}, False
    for line in report:
        seen = seen or line.startswith("Root Cause")
        match = FIELD.match(line) if seen else None
        if match:
            fields.setdefault(match.group(1), match.group(2).strip())
    if not fields:
        return ""
    who = f"rank {fields.get('rank', '?').split(' ')[0]} on {fields.get('host', '?')}"
    signal = re.search(r"Signal \d+ \(\w+\)", fields.get("traceback", ""))
    if signal:
        return f"{who} was killed by {signal.group(0)}"
    return f"{who} exited with {fields.get('exitcode', '?').split(' ')[0]}"


def run_dir(args: list[str]) -> Path:
    try:
        from engine.config.schema import load_config
        config = args[args.index("--config") + 1] if "--config" in args else None
        return Path(load_config(config, [a for a in args if "=" in a and not a.startswith("-")]).run.dir)
    except Exception:  # the ranks already said what is wrong with the configuration
        return Path(".")


def main(argv: list[str]) -> int:
    reason_file, config_args = Path(argv[0]), argv[1:]
    kept, said, report, first_said = [], set(), None, ""
    held: list[str] = []  # a traceback whose origin is not known yet
    for line in sys.stdin:
        if report is not None:
            report.append(line)
            continue
        if held:
            held.append(line)
            if "torch/distributed/run.py" in line or "torch/distributed/launcher" in line:
                report, held = held, []  # torchrun's own traceback: the report, to the end
            elif not line.startswith((" ", "\t")) and len(held) > 1:
                sys.stderr.writelines(held)
                held = []
            continue
        if line.startswith("Traceback (most recent call last):"):
            held = [line]
        elif TORCH_LOG.match(line):
            kept.append(line)
        elif line.startswith("trilith:"):
            if line not in said:
                said.add(line)
                first_said = first_said or line.strip()
                sys.stderr.write(line)
        else:
            sys.stderr.write(line)
        sys.stderr.flush()
    sys.stderr.writelines(held)
    if report is None and not kept:
        return 0
    log = run_dir(config_args) / "logs" / "torchrun.log"
    try:
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "a") as f:
            f.writelines(kept + (report or []))
    except OSError:
        log = Path("(not kept: logs/ is not writable)")
    cause = root_cause(report or [])
    reason = cause if "killed by" in cause else first_said or cause or "the ranks failed"
    reason_file.write_text(f"{reason} (torchrun's report: {log})\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
