"""DeepSpeed hostfile -> resource spec (``nodeops import-hostfile``)."""

from __future__ import annotations

import re
from typing import Any

import yaml

from nodeops.errors import SpecError, SpecIssue
from nodeops.spec.deepspeed import parse_hostfile_lines
from nodeops.spec.load import load_spec_text

_NODE_FIELD = re.compile(r"^nodes\[(\d+)\]")


def spec_from_hostfile(
    text: str, file: str, *, user: str | None = None, key_file: str | None = None, port: int = 22
) -> tuple[str, list[str]]:
    """Return the spec YAML for a hostfile and warnings. Errors name the hostfile's line."""
    hosts = parse_hostfile_lines(text, file)
    warnings: list[str] = []
    kept: list[tuple[str, int, int]] = []
    for host, (slots, line) in hosts.items():
        if slots == 0:
            warnings.append(f"{file}:{line}: {host} has slots=0 and would run no process; left out of the spec")
        else:
            kept.append((host, slots, line))
    if not kept:
        raise SpecError(
            [SpecIssue(file, 1, 1, "hostfile", "every host has slots=0", "give at least one host slots>=1")]
        )
    group: dict[str, Any] = {"port": port}
    if user:
        group["username"] = user
    if key_file:
        group["key_file"] = key_file
    nodes: list[dict[str, Any]] = []
    for i, (host, slots, _line) in enumerate(kept):
        node: dict[str, Any] = {"address": host, "gpus": list(range(slots))}
        if i == 0:
            node["chief"] = True
        node["ssh_config"] = "default"
        nodes.append(node)
    data = {"nodes": nodes, "ssh": {"default": group}}
    out = f"# Imported by nodeops from DeepSpeed hostfile {file}\n" + yaml.safe_dump(
        data, sort_keys=False, default_flow_style=None
    )
    try:
        loaded = load_spec_text(out, file)
    except SpecError as e:
        raise SpecError([_to_hostfile_issue(i, kept, file) for i in e.issues]) from None
    warnings.extend(f"{w.field}: {w.message}" for w in loaded.warnings)
    return out, warnings


_OPTIONS = {"ssh.default.username": "--user", "ssh.default.key_file": "--key-file", "ssh.default.port": "--port"}


def _to_hostfile_issue(issue: SpecIssue, kept: list[tuple[str, int, int]], file: str) -> SpecIssue:
    option = next((o for f, o in _OPTIONS.items() if issue.field.startswith(f)), None)
    if option is not None:  # a bad option value, not a line of the hostfile
        return SpecIssue(option, 0, 0, option, issue.message, issue.fix, issue.severity)
    m = _NODE_FIELD.match(issue.field)
    line = kept[int(m.group(1))][2] if m else 1
    fix = issue.fix
    if "loopback" in issue.message:
        fix = "use an address the other nodes can reach instead of localhost/127.0.0.1"
    elif "user name" in issue.message:
        fix = "write the bare host in the hostfile and pass --user"
    return SpecIssue(file, line, 1, issue.field, issue.message, fix, issue.severity)
