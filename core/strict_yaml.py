"""YAML read strictly: one value per key, no anchors or aliases (they multiply what a small file holds)."""

from __future__ import annotations

from pathlib import Path

import yaml
from yaml.constructor import ConstructorError
from yaml.nodes import MappingNode

from tic.core.errors import TicInputError
from tic.core.fsio import read_input_text


class StrictSafeLoader(yaml.SafeLoader):
    """SafeLoader that refuses aliases, anchors and duplicate mapping keys."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise ConstructorError(None, None, f"alias *{event.anchor} is not allowed (write the value out)",
                                   event.start_mark)
        event = self.peek_event()
        anchor = getattr(event, "anchor", None)
        if anchor is not None:
            raise ConstructorError(None, None, f"anchor &{anchor} is not allowed (write the value out)",
                                   event.start_mark)
        return super().compose_node(parent, index)

    def construct_mapping(self, node: MappingNode, deep: bool = False):
        seen: set = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                hash(key)
            except TypeError:
                raise ConstructorError(None, None, "a mapping key must be a plain value", key_node.start_mark)
            if key in seen:
                raise ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _where(err: yaml.YAMLError) -> str:
    mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
    return f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""


def load_yaml_file(path: Path):
    """Parse a YAML file strictly; any problem is a one-line TicInputError naming the file."""
    path = Path(path)
    text = read_input_text(path, "config file")
    try:
        return yaml.load(text, Loader=StrictSafeLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as err:
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise TicInputError(f"{path}: not valid YAML: {problem}{_where(err)}") from None
    except RecursionError:
        raise TicInputError(f"{path}: not valid YAML: nested too deeply") from None
