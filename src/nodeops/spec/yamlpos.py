"""YAML loading that remembers where every key and value came from.

PyYAML's composer already records a start mark on every node; we walk the
composed tree once and keep a map from the data path (a tuple of keys and list
indices) to the line/column of the key and of the value. That lets spec errors
point at ``file:line:col`` without a second parser.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


@dataclass(frozen=True)
class Pos:
    line: int  # 1-based
    col: int  # 1-based


Path_ = tuple[str | int, ...]


@dataclass
class Located:
    """Parsed YAML data plus the positions of every key and value in it."""

    data: Any
    file: str
    keys: dict[Path_, Pos] = field(default_factory=dict)
    values: dict[Path_, Pos] = field(default_factory=dict)

    def pos(self, path: Path_) -> Pos:
        """Best position for an error at ``path``.

        The key's position if the key exists (so "unknown field" and "bad value"
        point at the offending line), otherwise the nearest existing parent,
        which is where a missing field would have to be added.
        """
        for i in range(len(path), -1, -1):
            p = tuple(path[:i])
            if p in self.keys:
                return self.keys[p]
            if p in self.values:
                return self.values[p]
        return Pos(1, 1)

    # Data that did not come from one YAML file (an Ansible inventory and its group_vars/host_vars):
    # the file each path came from, and how to name it to the user ("node2: ansible_port").
    files: dict[Path_, str] = field(default_factory=dict)
    labels: dict[Path_, str] = field(default_factory=dict)

    def where(self, path: Path_) -> tuple[str, Pos, str | None]:
        """(file, position, label) for an error at ``path``: the nearest recorded ancestor's."""
        for i in range(len(path), -1, -1):
            p = tuple(path[:i])
            if p in self.keys or p in self.values or p in self.labels:
                pos = self.keys.get(p) or self.values.get(p) or Pos(0, 0)
                return self.files.get(p, self.file), pos, self.labels.get(p)
        return self.file, Pos(1, 1), None


class YamlSyntaxError(ValueError):
    def __init__(self, file: str, pos: Pos, message: str, fix: str = "fix the YAML syntax") -> None:
        super().__init__(f"{file}:{pos.line}:{pos.col}: {message}")
        self.file = file
        self.pos = pos
        self.message = message
        self.fix = fix


# libyaml's parser is ~10x faster than the pure-Python one on a 1,000-node spec; both keep marks.
_BaseLoader: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class _UniqueKeyLoader(_BaseLoader):  # type: ignore[valid-type,misc]
    """Safe loader that rejects duplicate mapping keys instead of silently keeping the last."""


def _mark(node: yaml.Node) -> Pos:
    return Pos(node.start_mark.line + 1, node.start_mark.column + 1)


def _walk(loader: _UniqueKeyLoader, node: yaml.Node, path: Path_, out: Located) -> None:
    out.values[path] = _mark(node)
    if isinstance(node, yaml.MappingNode):
        seen: dict[Any, Pos] = {}
        loader.flatten_mapping(node)
        for key_node, value_node in node.value:
            key = loader.construct_object(key_node, deep=True)
            if not isinstance(key, str | int):
                raise YamlSyntaxError(out.file, _mark(key_node), f"mapping key {key!r} must be a string")
            if key in seen:
                first = seen[key]
                raise YamlSyntaxError(
                    out.file,
                    _mark(key_node),
                    f"duplicate key {key!r} (first defined at line {first.line}); remove one of them",
                )
            seen[key] = _mark(key_node)
            out.keys[(*path, key)] = _mark(key_node)
            _walk(loader, value_node, (*path, key), out)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            out.keys[(*path, i)] = _mark(item)
            _walk(loader, item, (*path, i), out)


def load_text(text: str, file: str = "<string>") -> Located:
    loader = _UniqueKeyLoader(text)
    try:
        node = loader.get_single_node()
        out = Located(data=None, file=file)
        if node is None:
            return out
        _walk(loader, node, (), out)
        out.data = loader.construct_document(node)
        return out
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        pos = Pos(mark.line + 1, mark.column + 1) if mark else Pos(1, 1)
        raise YamlSyntaxError(file, pos, f"invalid YAML: {e.problem or e.context}") from None
    finally:
        loader.dispose()


def load_file(path: str | Path) -> Located:
    p = Path(path)
    data = p.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        col = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise YamlSyntaxError(str(p), Pos(line, col), f"byte 0x{data[e.start]:02x} is not UTF-8 ({e.reason})",
                              fix="save the file as UTF-8 (e.g. `iconv -f latin1 -t utf-8`)") from None  # fmt: skip
    return load_text(text, str(p))
