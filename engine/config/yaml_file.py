"""YAML text to plain Python data for the run configuration, bounded against hostile or damaged input.

PyYAML composes an alias as a second reference to the node it names, so a few hundred bytes of aliases of
aliases ("billion laughs") parse at once but stand for billions of values when anything walks the result
(type coercion, printing, saving the run's configuration). The composed node graph is therefore walked as
its expanded tree, before any Python object is constructed, and refused past MAX_NODES values or MAX_DEPTH
levels; an alias inside the node it names (a cycle) is infinitely deep and refused the same way. Every
failure is one line: the position and the problem, never PyYAML's multi-line excerpt.
"""
from __future__ import annotations

import yaml

MAX_NODES = 100_000  # values after alias expansion; a full configuration has a few hundred
MAX_DEPTH = 32  # nesting levels; a configuration needs four (document, section, list, value)


class YAMLInputError(Exception):
    """Text that is not one bounded YAML document; the message is a single line without the file name."""


def _where(mark) -> str:
    return f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "somewhere"


class _BoundedLoader(yaml.SafeLoader):
    def __init__(self, stream):
        super().__init__(stream)
        self.depth = 0

    def compose_node(self, parent, index):
        # PyYAML composes recursively: refuse deep nesting before Python's recursion limit is reached.
        self.depth += 1
        try:
            if self.depth > MAX_DEPTH:
                where = _where(self.peek_event().start_mark)
                raise YAMLInputError(f"nested more than {MAX_DEPTH} levels deep at {where}")
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1

    def construct_object(self, node, deep=False):
        # PyYAML's scalar constructors fail with whatever the conversion raises (ValueError for `!!int x` or the
        # date 2024-13-01, KeyError for `!!bool maybe`, AttributeError for `!!timestamp x`): name the value.
        try:
            return super().construct_object(node, deep=deep)
        except (yaml.YAMLError, YAMLInputError):
            raise
        except Exception as exc:
            kind = node.tag.rsplit(":", 1)[-1]
            raise YAMLInputError(f"{_where(node.start_mark)}: {str(node.value)[:60]!r} is not a valid {kind} "
                                 f"({type(exc).__name__}: {exc})") from exc

    def compose_document(self):
        node = super().compose_document()
        _check_expanded_size(node)
        return node


def _check_expanded_size(root) -> None:
    """Walk the tree the aliases stand for (no memo: the walk itself stops after MAX_NODES visits)."""
    visited = 0
    stack = [(root, 1)]
    while stack:
        node, depth = stack.pop()
        visited += 1
        if visited > MAX_NODES:
            raise YAMLInputError(f"expands to more than {MAX_NODES} values through aliases (&anchor / *alias) "
                                 f"near {_where(node.start_mark)}; write the values out")
        if depth > MAX_DEPTH:
            raise YAMLInputError(f"nested more than {MAX_DEPTH} levels deep through aliases near "
                                 f"{_where(node.start_mark)} (an alias inside the node it names?)")
        if isinstance(node, yaml.SequenceNode):
            stack.extend((child, depth + 1) for child in node.value)
        elif isinstance(node, yaml.MappingNode):
            stack.extend((child, depth + 1) for pair in node.value for child in pair)


def _one_line(exc: Exception) -> str:
    if isinstance(exc, yaml.MarkedYAMLError):
        parts = [p for p in (exc.context, exc.problem) if p]
        text = f"{_where(exc.problem_mark or exc.context_mark)}: {', '.join(parts) or type(exc).__name__}"
    else:
        text = str(exc) or type(exc).__name__
    return " ".join(text.split())


def load_yaml(text: str):
    """The single YAML document in `text` as dicts, lists and scalars; YAMLInputError when it is not one."""
    try:
        return yaml.load(text, Loader=_BoundedLoader)
    except yaml.YAMLError as exc:
        raise YAMLInputError(_one_line(exc)) from exc
