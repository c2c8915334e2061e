"""The documentation stays true: the configuration reference is the generated one, every relative link in
README.md and docs/ points at a file that exists, every code path and `Class.member` they name exists,
README stays an entry page, its test count is the suite's, the memory estimate docs/memory.md shows is
what the tool prints today, and every tool command the pages show parses under the tool's own options."""
import ast
import functools
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import ROOT
from tests.s3_server import S3Server
from tools import gen_config_docs

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE_PATH = re.compile(r"`((?:engine|parallel|kernels|data|tools|launch|tests)/[\w/.]*)(?::(\w+)(?:\.(\w+))?)?`")
MEMBER = re.compile(r"`([A-Z]\w+)\.(\w+)`")
EXTERNAL = {"AutoModelForCausalLM"}  # transformers' classes, named where the docs describe interoperability


def test_configuration_reference_is_generated_from_the_dataclasses():
    committed = (ROOT / "docs" / "configuration.md").read_text()
    assert committed == gen_config_docs.render(), \
        "docs/configuration.md is out of date: run python tools/gen_config_docs.py"


def test_every_config_key_is_in_the_reference():
    text = gen_config_docs.render()
    for section, keys in (("model", ("hidden_size", "attention_backend")), ("parallel", ("zero_stage",)),
                          ("checkpoint", ("mirror_dir",)), ("run", ("replica_check_interval",))):
        for key in keys:
            assert f"| `{section}.{key}` |" in text


@dataclass
class _Documented:
    """A section for the tests."""
    plain: int = 1  # one line
    wrapped: str = "a|b"  # first line
        # second line, indented deeper
    # a group heading above a field with its own comment: not part of either field
    after: bool = False  # the next field
    # a comment written above a field
    # that has none on its line
    above: int = 2


@dataclass
class _Undocumented:
    """A section with a field nobody explained."""
    bare: int = 0


def test_a_field_comment_is_its_line_and_the_deeper_lines_below_it():
    assert gen_config_docs.field_comments(_Documented) == {
        "plain": "one line", "wrapped": "first line second line, indented deeper", "after": "the next field",
        "above": "a comment written above a field that has none on its line"}
    rows = gen_config_docs.section_table("demo", _Documented)
    assert "| `demo.wrapped` | str | `a\\|b` | first line second line, indented deeper |" in rows


def test_a_field_without_a_comment_is_refused_with_the_fix():
    with pytest.raises(gen_config_docs.UndocumentedField, match=r"_Undocumented\.bare has no comment.*"
                                                                 r"python tools/gen_config_docs\.py"):
        gen_config_docs.section_table("demo", _Undocumented)


def without_code_blocks(page: Path) -> str:
    return re.sub(r"```.*?```", "", page.read_text(), flags=re.S)


def relative_links(page: Path) -> list[str]:
    return [t for t in LINK.findall(without_code_blocks(page)) if not re.match(r"[a-z]+:", t)]


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as hyphens."""
    headings = re.findall(r"^#+ (.+)$", without_code_blocks(page), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def broken_links(page: Path) -> list[str]:
    broken = []
    for link in relative_links(page):
        path, _, anchor = link.partition("#")
        target = page.parent / path if path else page
        if not target.exists() or (anchor and target.suffix == ".md" and anchor not in anchors(target)):
            broken.append(link)
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_at_existing_files_and_headings(page):
    broken = broken_links(page)
    assert not broken, f"{page.relative_to(ROOT)} links to missing files or headings: {broken}"


def test_the_link_check_sees_a_broken_link(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Top (`a.py`)\n[ok](page.md) [gone](docs/missing.md#part) [web](https://example.org) "
                    "[here](#top-apy) [lost](#nowhere) [heading](page.md#no-such-heading)\n"
                    "```\n[in code](nowhere.md)\n```\n")
    assert relative_links(page) == ["page.md", "docs/missing.md#part", "#top-apy", "#nowhere",
                                    "page.md#no-such-heading"]
    assert broken_links(page) == ["docs/missing.md#part", "#nowhere", "page.md#no-such-heading"]


def test_readme_is_an_entry_page():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= 200, f"README.md has {lines} lines; move reference material into docs/"


@functools.cache
def defined_names(path: Path) -> dict[str, set[str]]:
    """{"": top-level functions and classes, class name: its methods and attributes} of a Python file."""
    names: dict[str, set[str]] = {"": set()}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names[""].add(node.name)
        if isinstance(node, ast.ClassDef):
            members = names.setdefault(node.name, set())
            for inner in ast.walk(node):
                if isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    members.add(inner.name)
                elif isinstance(inner, ast.Attribute) and isinstance(inner.ctx, ast.Store):
                    members.add(inner.attr)
                elif isinstance(inner, ast.AnnAssign) and isinstance(inner.target, ast.Name):
                    members.add(inner.target.id)
    return names


@functools.cache
def code_index() -> dict[str, set[str]]:
    index: dict[str, set[str]] = {}
    for folder in ("engine", "parallel", "kernels", "data", "tools"):
        for path in (ROOT / folder).rglob("*.py"):
            for cls, members in defined_names(path).items():
                if cls:
                    index.setdefault(cls, set()).update(members)
    return index


def missing_code(page: Path, index: dict[str, set[str]]) -> list[str]:
    text = page.read_text()
    missing = []
    for path, name, member in CODE_PATH.findall(text):
        target = ROOT / path
        if not target.exists():
            missing.append(path)
        elif member and member not in defined_names(target).get(name, set()):
            missing.append(f"{path}:{name}.{member}")
        elif name and name not in set().union(*defined_names(target).values()):
            missing.append(f"{path}:{name}")
    for cls, member in MEMBER.findall(text):
        if cls not in EXTERNAL and member not in index.get(cls, set()):
            missing.append(f"{cls}.{member}")
    return missing


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_code_named_in_the_docs_exists(page):
    missing = missing_code(page, code_index())
    assert not missing, f"{page.relative_to(ROOT)} names code that does not exist (moved or renamed?): {missing}"


def test_the_code_check_sees_a_renamed_function(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("`engine/train.py:main` `engine/train.py:no_such_function` `engine/nowhere.py` "
                    "`engine/train.py:Trainer.train_step` `engine/train.py:Trainer.gone` "
                    "`Trainer.train_step` `Trainer.no_such_method` `NoSuchClass.step`\n")
    assert missing_code(page, code_index()) == ["engine/train.py:no_such_function", "engine/nowhere.py",
                                                "engine/train.py:Trainer.gone", "Trainer.no_such_method",
                                                "NoSuchClass.step"]


def suite_count() -> int:
    """What `pytest --collect-only` collects from tests/ (about 20 s on 2 cores: it imports every test file)."""
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "tests"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    collected = re.search(r"^(\d+) tests? collected", done.stdout, flags=re.M)
    assert collected, f"pytest --collect-only failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
    return int(collected.group(1))


def test_readme_test_count_is_the_suites(whole_suite_collected):
    """The number README gives is what `pytest --collect-only` collects; a session that collected the whole
    suite (`make test`) already knows it (tests/conftest.py), any other collects it again."""
    stated = re.findall(r"([\d,]+) tests\b", (ROOT / "README.md").read_text())
    assert len(stated) == 1, f"README.md should state the test count once, as 'N tests'; found {stated}"
    collected = whole_suite_collected if whole_suite_collected is not None else suite_count()
    assert int(stated[0].replace(",", "")) == collected, \
        f"README.md says {stated[0]} tests, the suite collects {collected}: update README.md"


MEMORY_EXAMPLE = re.compile(r"```bash\n(python tools/estimate_memory\.py [^\n]+)\n```\n\nprints[^\n]*\n\n```\n(.*?)```", re.S)


def test_memory_example_is_what_the_tool_prints():
    """docs/memory.md's example output is generated: the command above it, run now, prints exactly it."""
    example = MEMORY_EXAMPLE.search((ROOT / "docs" / "memory.md").read_text())
    assert example, "docs/memory.md lost its example: a bash block with the command, 'prints', the output block"
    command, shown = example.groups()
    done = subprocess.run([sys.executable, *shlex.split(command)[1:]], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout == shown, f"docs/memory.md's example is stale; paste what `{command}` prints now:\n{done.stdout}"


ESTIMATES = sorted({line.strip() for page in PAGES for line in page.read_text().splitlines()
                    if line.strip().startswith("python tools/estimate_memory.py ")})


@pytest.mark.parametrize("command", ESTIMATES)
def test_every_memory_estimate_the_docs_show_runs_as_written(command):
    done = subprocess.run([sys.executable, *shlex.split(command)[1:]], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def shell_commands(page: Path) -> list[str]:
    """The commands of a page's bash blocks, continuation lines joined, comments dropped."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", page.read_text(), re.S):
        for command in block.replace("\\\n", " ").splitlines():
            words = shlex.split(command, comments=True) if command.strip() else []
            if words:
                commands.append(shlex.join(words))
    return commands


LAUNCHERS = ("launch/run_pretrain.sh", "engine.train")


def launch_world_size(words: list[str]) -> int:
    """The ranks a documented launch starts, read as its launcher reads its options (run_pretrain.sh's own
    SLURM default is 8 tasks per node)."""
    def option(*names, default=None):
        for i, word in enumerate(words):
            for name in names:
                if word == name:
                    return int(words[i + 1])
                if word.startswith(name + "="):
                    return int(word.split("=", 1)[1])
        return default
    first = words[0]
    if first in ("mpirun", "mpiexec"):
        return option("-np", "-n")
    if first == "torchrun":
        return option("--nproc-per-node") * option("--nnodes", default=1)
    if first in ("sbatch", "srun"):
        return option("-n", "--ntasks") or option("--nodes", "-N", default=1) * option("--ntasks-per-node", default=8)
    return option("--world-size") or option("--nproc", default=1) * option("--nnodes", default=1)  # or a dry run


def documented_launches() -> list[tuple[str, str]]:
    return [(str(page.relative_to(ROOT)), command) for page in PAGES for command in shell_commands(page)
            if any(launcher in command for launcher in LAUNCHERS) and "--config" in command]


def launch_check_arguments(command: str) -> list[str]:
    words = shlex.split(command)
    config = words.index("--config")
    overrides = [w for w in words[config + 2:] if "=" in w and not w.startswith("-")]
    preflight = ["--preflight"] if "--preflight" in words else []
    return ["--world-size", str(launch_world_size(words)), *preflight, "--config", words[config + 1], *overrides]


CHECK_EACH = """
import contextlib, io, json, runpy, sys
check = runpy.run_path("launch/check.py", run_name="check")["main"]
results = []
for arguments in json.load(sys.stdin):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = check(arguments)
    results.append([code, err.getvalue().strip()])
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def launch_checks(tmp_path_factory):
    """launch/check.py's verdict (status, refusal) on every documented launch, from one process: the launcher's
    own first step, without a Python start-up per command. Their s3:// buckets are in a real store
    (tests/s3_server.py), as the page's own lines start one."""
    launches = documented_launches()
    arguments = [[w for w in launch_check_arguments(command) if not w.startswith("checkpoint.load=")]
                 for _, command in launches]  # a checkpoint.load is made by an earlier command
    buckets = sorted({b for _, command in launches for b in re.findall(r"s3://([a-z0-9][a-z0-9.-]*)", command)})
    with S3Server(tmp_path_factory.mktemp("s3") / "store", buckets) as server:
        done = subprocess.run([sys.executable, "-c", CHECK_EACH], cwd=ROOT, input=json.dumps(arguments),
                              capture_output=True, text=True, timeout=300, env={**os.environ, **server.env()})
    assert done.returncode == 0, done.stderr[-2000:]
    return dict(zip(launches, json.loads(done.stdout.splitlines()[-1])))


@pytest.mark.parametrize("page,command", documented_launches())
def test_every_documented_launch_configures_a_valid_run(launch_checks, page, command):
    """Each training launch the docs show names a shipped config that validates at the world size its launcher
    starts (launch/check.py) — except that its data and GPUs are the reader's."""
    code, refusal = launch_checks[(page, command)]
    gpu_only = "train.device=cuda asks for GPUs, but CUDA is not usable" in refusal  # checked after the config
    assert code == 0 or gpu_only, f"{page}: `{command}` is refused before any rank starts: {refusal}"


def test_launch_world_sizes_are_read_as_the_launchers_read_them():
    sizes = {"launch/run_pretrain.sh --nproc 8 --nnodes 2 --config c": 16,
             "torchrun --nproc-per-node 4 -m engine.train --config c": 4,
             "sbatch launch/run_pretrain.sh --config c": 8, "sbatch -n 16 launch/run_pretrain.sh --config c": 16,
             "sbatch --nodes=8 --ntasks-per-node=8 launch/run_pretrain.sh --config c": 64,
             "mpirun -np 16 launch/run_pretrain.sh --config c": 16, "python -m engine.train --config c": 1}
    assert {c: launch_world_size(shlex.split(c)) for c in sizes} == sizes


TOOL = re.compile(r"tools/(\w+)\.py")
SHELL_OPERATORS = {"|", "||", "&&", ";", ">", ">>", "2>&1", "&"}


def block_commands(page: Path) -> list[str]:
    """The commands that run a tool in a page's code blocks (bash, sh, console or unmarked; output lines do not
    start a tool; continuation lines joined, comments dropped) and in its inline code."""
    commands, blocks, prose, fence = [], [], [], None
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fence = line[3:].strip() if fence is None else None
            if fence is not None:
                blocks.append([])
        elif fence is None:
            prose.append(line)
        elif fence in ("", "bash", "sh", "shell", "console"):
            blocks[-1].append(line)
    for block in blocks:
        for line in "\n".join(block).replace("\\\n", " ").splitlines():
            if TOOL.search(line) and "python" in line:
                words = shlex.split(line.lstrip("$ "), comments=True)
                if words:
                    commands.append(shlex.join(words))
    for span in re.findall(r"`((?:[A-Z_]+=\S+ |nice -n \d+ )*python3? tools/\w+\.py[^`]*)`", "\n".join(prose)):
        commands.append(shlex.join(shlex.split(" ".join(span.split()))))
    return commands


def documented_tool_commands(pages=tuple(PAGES)) -> list[tuple[str, str, list[str]]]:
    """(page, command, the tool's argv) for each `python tools/X.py ...` the pages show."""
    found = []
    for page in pages:
        for command in block_commands(page):
            words = shlex.split(command)
            for i, word in enumerate(words[:-1]):
                if re.fullmatch(r"python3?", Path(word).name) and TOOL.fullmatch(words[i + 1]):
                    argv = words[i + 1:]
                    cut = next((j for j, w in enumerate(argv) if w in SHELL_OPERATORS), len(argv))
                    found.append((page.name, command, argv[:cut]))
                    break
    return found


PARSE_EACH = """
import argparse, contextlib, io, json, runpy, sys
class Parsed(Exception):
    pass
parse_args = argparse.ArgumentParser.parse_args
def parse_then_stop(self, args=None, namespace=None):
    parse_args(self, args, namespace)
    raise Parsed
argparse.ArgumentParser.parse_args = parse_then_stop
results = []
for argv in json.load(sys.stdin):
    sys.argv, err = argv, io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            runpy.run_path(argv[0], run_name="__main__")
        results.append("the tool ended without parsing its arguments")
    except Parsed:
        results.append("")
    except SystemExit as exc:
        said = err.getvalue().strip().splitlines() or [f"exit status {exc.code}"]
        results.append("" if exc.code in (0, None) else said[-1])
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def tool_parses():
    """Each documented tool command's verdict from the tool's own argument parser, in one process: the tool is
    run as __main__ and stopped as soon as its arguments parse (nothing is computed)."""
    commands = documented_tool_commands()
    return dict(zip([(p, c) for p, c, _ in commands], parse_verdicts([argv for *_, argv in commands])))


@pytest.mark.parametrize("page,command", [(p, c) for p, c, _ in documented_tool_commands()])
def test_every_documented_tool_command_parses_as_written(tool_parses, page, command):
    assert tool_parses[(page, command)] == "", f"{page}: `{command}`: {tool_parses[(page, command)]}"


def parse_verdicts(argvs: list[list[str]]) -> list[str]:
    done = subprocess.run([sys.executable, "-c", PARSE_EACH], cwd=ROOT, input=json.dumps(argvs),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_the_tool_check_sees_an_option_the_tool_does_not_have(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("```bash\nnice -n 5 python tools/estimate_memory.py --config launch/configs/tiny.yaml \\\n"
                    "  --no-such-option 3 | tail -1\nOMP_NUM_THREADS=1 python tools/estimate_memory.py "
                    "--config launch/configs/tiny.yaml\n```\n")
    commands = documented_tool_commands((page,))
    assert [argv for *_, argv in commands] == [
        ["tools/estimate_memory.py", "--config", "launch/configs/tiny.yaml", "--no-such-option", "3"],
        ["tools/estimate_memory.py", "--config", "launch/configs/tiny.yaml"]]
    refused, parsed = parse_verdicts([argv for *_, argv in commands])
    assert "unrecognized arguments: --no-such-option" in refused and parsed == ""
