"""Loading a resource spec: from YAML with positions to a validated :class:`LoadedSpec`, or one
:class:`SpecError` listing every problem at once, each with ``file:line:col``, the field, what
is wrong and how to fix it. The schema itself is :mod:`nodeops.spec.model`.

Loading happens in three steps:

1. YAML is parsed with positions (:mod:`nodeops.spec.yamlpos`).
2. The old ungrouped ``ssh:`` form is normalised to one group, and pydantic validates the
   shape (every structural error is collected).
3. Cross-field rules (one chief, unique addresses, group references, loopback) run on the
   raw data, defensively, so they are reported even when step 2 also found problems.
"""

from __future__ import annotations

import difflib
import os
import re
import types
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ValidationError

from nodeops.errors import SpecError, SpecIssue
from nodeops.spec import timeouts
from nodeops.spec.model import GROUP_KEYS, LEGACY_GROUP, LoadedSpec, ResourceSpec, is_loopback, issue_at
from nodeops.spec.yamlpos import Located, YamlSyntaxError, load_file, load_text


def _is_legacy_ssh(ssh: Any) -> bool:
    return isinstance(ssh, dict) and any(k in GROUP_KEYS and not isinstance(v, dict) for k, v in ssh.items())


def _display(loc: tuple[str | int, ...], legacy: bool) -> tuple[str | int, ...]:
    """Map a validated path back to the path as written (the legacy group has no name)."""
    if loc and loc[-1] == "[key]":
        loc = loc[:-1]
    if legacy and loc[:2] == ("ssh", LEGACY_GROUP):
        return ("ssh", *loc[2:])
    return loc


def _unwrap(tp: Any) -> Any:
    while True:
        origin = typing.get_origin(tp)
        if origin is Annotated:
            tp = typing.get_args(tp)[0]
        elif origin in (typing.Union, types.UnionType):
            args = [a for a in typing.get_args(tp) if a is not type(None)]
            tp = args[0] if len(args) == 1 else tp
            if len(args) != 1:
                return tp
        else:
            return tp


def _model_at(loc: tuple[str | int, ...]) -> type[BaseModel] | None:
    """The pydantic model that owns the field at ``loc`` (used to list allowed keys)."""
    tp: Any = ResourceSpec
    for part in loc:
        tp = _unwrap(tp)
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            f = tp.model_fields.get(str(part))
            if f is None:
                return None
            tp = f.annotation
        elif typing.get_origin(tp) in (list, dict):
            tp = typing.get_args(tp)[-1]
        else:
            return None
    tp = _unwrap(tp)
    return tp if isinstance(tp, type) and issubclass(tp, BaseModel) else None


_TYPE_FIX = {
    "int_type": "write a whole number, e.g. 22",
    "int_parsing": "write a whole number, e.g. 22",
    "int_from_float": "write a whole number, e.g. 22",
    "float_type": "write a number",
    "float_parsing": "write a number",
    "bool_type": "write true or false",
    "bool_parsing": "write true or false",
    "string_type": "write a string; quote it if YAML reads it as something else",
    "list_type": "write a list, e.g. [0, 1]",
    "dict_type": "write a mapping of `key: value` lines",
    "model_type": "write a mapping of `key: value` lines",
    "model_attributes_type": "write a mapping of `key: value` lines",
    "greater_than_equal": "use a larger value",
    "greater_than": "use a larger value",
    "less_than_equal": "use a smaller value",
    "too_short": "add at least one entry",
    "frozen_instance": "",
}


_BRANCH = re.compile(r"^(list|literal)\[.*\]$")  # pydantic's names for the members of `list[...] | Literal[...]`


def _without_union_branches(errors: list[Any]) -> list[Any]:
    """``gpus: list[int] | Literal["auto"]`` fails in both branches: report it once, at the value
    as written. A list with a bad element keeps the list branch's error (``gpus[1]``); anything
    else (``gpus: two``) becomes one error saying what the field takes."""

    def split(err: Any) -> tuple[int | None, tuple[Any, ...]]:
        loc = tuple(err["loc"])
        i = next((i for i, p in enumerate(loc) if isinstance(p, str) and _BRANCH.match(p)), None)
        return i, loc

    elements = set()  # fields whose value was a list with a bad element
    for err in errors:
        i, loc = split(err)
        if i is not None and str(loc[i]).startswith("list") and len(loc) > i + 1:
            elements.add(loc[:i])
    out, seen = [], set()
    for err in errors:
        i, loc = split(err)
        if i is None:
            out.append(err)
        elif loc[:i] in elements:
            if str(loc[i]).startswith("list") and len(loc) > i + 1:
                out.append({**err, "loc": loc[:i] + loc[i + 1 :]})
        elif loc[:i] not in seen:
            seen.add(loc[:i])
            fix = "write e.g. [0, 1], or auto (setup discovers them)"
            out.append({**err, "loc": loc[:i], "type": "nodeops", "ctx": {"fix": fix},
                        "msg": f"{err.get('input')!r} is not a list of GPU ids or 'auto'"})  # fmt: skip
    return out


def _issue_from_pydantic(err: Mapping[str, Any], located: Located, legacy: bool) -> SpecIssue:
    loc = _display(tuple(err["loc"]), legacy)
    kind = err["type"]
    ctx = err.get("ctx") or {}
    message = err["msg"]
    if kind == "nodeops":
        fix = ctx["fix"]
    elif kind == "missing":
        fix = f"add `{loc[-1]}:` here"
        message = f"required field `{loc[-1]}` is missing"
    elif kind == "extra_forbidden":
        owner = _model_at(tuple(err["loc"])[:-1])
        allowed = sorted(owner.model_fields) if owner else []
        close = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
        fix = f"did you mean `{close[0]}`?" if close else f"remove it; allowed here: {', '.join(allowed)}"
        message = f"unknown field `{loc[-1]}`"
    elif kind == "literal_error":
        fix = f"use {ctx.get('expected', 'one of the allowed values')}"
    else:
        fix = _TYPE_FIX.get(kind, "see `nodeops schema` for the expected shape")
    return issue_at(located, loc, message, fix)


def _cross_checks(raw: dict[str, Any], located: Located, legacy: bool) -> list[SpecIssue]:
    """Rules that span several fields. Runs on raw data so it works even if the shape is partly wrong."""
    issues: list[SpecIssue] = []

    def add(loc: tuple[str | int, ...], message: str, fix: str) -> None:
        issues.append(issue_at(located, _display(loc, legacy), message, fix))

    nodes_raw = raw.get("nodes")
    if not isinstance(nodes_raw, list):
        nodes_raw = []
    nodes = [(i, n) for i, n in enumerate(nodes_raw) if isinstance(n, dict)]
    multi = len(nodes_raw) > 1
    chiefs = [i for i, n in nodes if n.get("chief") is True]
    if multi and not chiefs:
        add(("nodes",), f"{len(nodes_raw)} nodes but none is marked chief", "add `chief: true` to the rank-0 node")
    for i in chiefs[1:]:
        add(
            ("nodes", i, "chief"),
            f"more than one chief (nodes[{chiefs[0]}] is already chief)",
            "keep `chief: true` on exactly one node",
        )
    first_by: dict[tuple[str, str], int] = {}
    for i, n in nodes:
        for key in ("address", "name"):
            value = n.get(key)
            if not isinstance(value, str):
                continue
            norm = value.strip().lower()
            if (key, norm) in first_by:
                add(
                    ("nodes", i, key),
                    f"{key} {value!r} is also used by nodes[{first_by[(key, norm)]}]",
                    f"give every node a distinct {key}",
                )
            else:
                first_by[(key, norm)] = i
        address = n.get("address")
        if multi and isinstance(address, str) and is_loopback(address.strip()):
            add(
                ("nodes", i, "address"),
                f"{address!r} is a loopback address in a {len(nodes_raw)}-node spec; other nodes cannot reach it",
                "use an address the other nodes can reach, e.g. the host's LAN IP",
            )
    _slurm_checks(raw, nodes, add)
    _recovery_checks(raw, nodes, add)
    ssh_raw = raw.get("ssh")
    groups: dict[Any, Any] = ssh_raw if isinstance(ssh_raw, dict) else {}
    group_names = sorted(str(g) for g in groups)
    for i, n in nodes:
        ref = n.get("ssh_config")
        if ref is None:
            if len(group_names) > 1 and n.get("chief") is not True and multi:
                add(
                    ("nodes", i),
                    "non-chief node has no `ssh_config` and there are several ssh groups",
                    f"add `ssh_config:` with one of: {', '.join(group_names)}",
                )
            continue
        if not isinstance(ref, str):
            continue
        if legacy:
            add(
                ("nodes", i, "ssh_config"),
                "`ssh_config` names a group, but `ssh:` is in the old ungrouped form",
                "remove `ssh_config` or put the ssh settings under a group name",
            )
        elif ref not in groups:
            close = difflib.get_close_matches(ref, group_names, n=1)
            fix = (
                f"did you mean `{close[0]}`?"
                if close
                else (
                    f"use one of: {', '.join(group_names)}"
                    if group_names
                    else f"define `ssh: {{{ref}: {{username: ...}}}}`"
                )
            )
            add(("nodes", i, "ssh_config"), f"ssh group {ref!r} is not defined under `ssh:`", fix)
    return issues


def _slurm_checks(raw: dict[str, Any], nodes: list[tuple[int, dict[str, Any]]],
                  add: Callable[[tuple[str | int, ...], str, str], None]) -> None:  # fmt: skip
    """backend vs the slurm section, the login node, and what Slurm runs cannot do (yet)."""
    slurm = raw.get("slurm")
    backend = raw.get("backend")
    if backend == "slurm" and not isinstance(slurm, dict):
        add(("backend",), "backend is slurm but there is no `slurm:` section",
            "add slurm: {login: NODE, partition: ..., nodes: N}")  # fmt: skip
    if backend == "ssh" and isinstance(slurm, dict):
        add(("slurm",), "a `slurm:` section is given but backend is ssh", "remove one of them")
    if not isinstance(slurm, dict) or backend == "ssh":
        return
    login = slurm.get("login")
    names = [str(n.get(k)) for _, n in nodes for k in ("name", "address") if n.get(k) is not None]
    if isinstance(login, str) and login not in names:
        add(("slurm", "login"), f"login {login!r} is not a node under `nodes:`",
            "add the login node under `nodes:` (with its ssh group) and name it here")  # fmt: skip
    launch: dict[str, Any] = raw["launch"] if isinstance(raw.get("launch"), dict) else {}
    runner = launch.get("runner")
    restarts = _count(launch.get("restarts"))
    if _count(slurm.get("spare_nodes")) and not restarts:
        add(("slurm", "spare_nodes"), "a spare node runs only when a restart replaces a failed node, and "
            "launch.restarts is 0", "set launch.restarts (e.g. 3), or remove slurm.spare_nodes")  # fmt: skip
    if restarts and slurm.get("gpus") is not None:
        add(("slurm", "gpus"), "gpus is a total (sbatch --gpus): Slurm would spread it over the spares too, and "
            "a restart's step on fewer nodes would ask for all of it",
            "use gpus_per_node with launch.restarts")  # fmt: skip
    if restarts and _count(slurm.get("max_requeues")):
        add(("slurm", "max_requeues"), "launch.restarts restarts the run inside its allocation (without the failed "
            "node); max_requeues would requeue the whole job as well", "keep one: launch.restarts, or "
            "slurm.max_requeues (which restarts on the same nodes)")  # fmt: skip
    if runner in ("mpirun", "deepspeed") and slurm.get("signal") is not None:
        add(("slurm", "signal"), "the time-limit signal goes to torchrun, which passes it to the ranks and gives "
            f"them its shutdown timeout; with runner {runner} nodeops cannot tell a run that finished from one "
            "the signal stopped", "use runner: torchrun, or remove slurm.signal")  # fmt: skip


def _recovery_checks(raw: dict[str, Any], nodes: list[tuple[int, dict[str, Any]]],
                     add: Callable[[tuple[str | int, ...], str, str], None]) -> None:  # fmt: skip
    """Spares, restarts and min_nodes together: what automatic recovery can do."""
    launch_raw = raw.get("launch")
    launch: dict[str, Any] = launch_raw if isinstance(launch_raw, dict) else {}
    restarts = _count(launch.get("restarts"))
    spares = [(i, n) for i, n in nodes if n.get("spare") is True]
    explicit = any(n.get("chief") is True for _, n in nodes)
    for i, n in spares:
        if n.get("chief") is True or (not explicit and i == nodes[0][0]):
            add(("nodes", i, "spare"), "the chief cannot be a spare (it runs rank 0 and the run's supervisor)",
                "mark another node as the spare")  # fmt: skip
        elif not restarts:
            add(("nodes", i, "spare"), "a spare runs only when a restart replaces a failed node, and launch.restarts "
                "is 0", "set launch.restarts (e.g. 3), or remove `spare: true`")  # fmt: skip
    runner = launch.get("runner")
    if restarts and runner not in (None, "torchrun"):
        add(("launch", "restarts"), f"automatic restarts relaunch torchrun on the new set of nodes; runner {runner} "
            "is not supported yet", "use runner: torchrun, or restarts: 0")  # fmt: skip
    if runner in ("mpirun", "deepspeed") and _count(launch.get("max_restarts")) > 0:
        add(("launch", "max_restarts"), f"max_restarts is torchrun's --max-restarts; runner {runner} has no such "
            "option and would ignore it", "remove launch.max_restarts, or use launch.restarts with runner: "
            "torchrun")  # fmt: skip
    min_nodes = _count(launch.get("min_nodes"))
    slurm = raw.get("slurm")
    on_slurm = isinstance(slurm, dict) and raw.get("backend") != "ssh"
    # on Slurm the job's nodes are a count (slurm.nodes); nodes: lists the login node
    active = (_count(slurm.get("nodes")) or 1) if on_slurm and isinstance(slurm, dict) else len(nodes) - len(spares)
    if min_nodes > active:
        what = "slurm.nodes" if on_slurm else "non-spare node(s)"
        add(("launch", "min_nodes"), f"min_nodes {min_nodes} is more than the {active} {what}",
            f"use at most {active}")  # fmt: skip


def _count(value: Any) -> int:
    """A count the spec gave (the model's own check reports a wrong type): 0 unless an int."""
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _warnings(spec: ResourceSpec, located: Located, legacy: bool) -> list[SpecIssue]:
    out: list[SpecIssue] = []
    for name, group in spec.ssh.items():
        for key in ("known_hosts",):  # a missing key_file: render.controller_issues
            value = getattr(group, key)
            if value is not None and not Path(os.path.expanduser(value)).is_file():
                loc = _display(("ssh", name, key), legacy)
                out.append(issue_at(located, loc, f"{value} does not exist on this machine",
                                     "create it, or fix the path before `setup`", severity="warning"))  # fmt: skip
    return out


def _normalise(data: Any) -> tuple[Any, bool]:
    if not isinstance(data, dict):
        return data, False
    legacy = _is_legacy_ssh(data.get("ssh"))
    if legacy:
        data = {**data, "ssh": {LEGACY_GROUP: data["ssh"]}}
    if data.get("ssh") is None and "ssh" in data:
        data = {k: v for k, v in data.items() if k != "ssh"}
    return data, legacy


def validate_located(located: Located) -> LoadedSpec:
    """Validate parsed YAML; raise :class:`SpecError` with every problem found."""
    raw = located.data
    if not isinstance(raw, dict):
        what = "empty" if raw is None else f"a {type(raw).__name__}"
        raise SpecError(
            [
                SpecIssue(
                    located.file,
                    1,
                    1,
                    "<top>",
                    f"the spec is {what}, not a mapping",
                    "start with `nodes:` followed by a list of nodes",
                )
            ]
        )
    data, legacy = _normalise(raw)
    issues: list[SpecIssue] = []
    spec: ResourceSpec | None = None
    try:
        spec = ResourceSpec.model_validate(data)
    except ValidationError as e:
        issues.extend(_issue_from_pydantic(err, located, legacy) for err in _without_union_branches(e.errors()))
    issues.extend(_cross_checks(data, located, legacy))
    order = timeouts.problems(spec) if spec is not None else []
    issues.extend(issue_at(located, _display(p.path, legacy), p.message, p.fix) for p in order if p.error)
    if issues or spec is None:
        issues.sort(key=lambda i: (i.line, i.col))
        raise SpecError(issues)
    warned = [issue_at(located, _display(p.path, legacy), p.message, p.fix, severity="warning")
              for p in order if not p.error]  # fmt: skip
    return LoadedSpec(spec=spec, file=located.file, warnings=_warnings(spec, located, legacy) + warned,
                      located=located, legacy=legacy)  # fmt: skip


def _syntax_issue(e: YamlSyntaxError) -> SpecError:
    return SpecError([SpecIssue(e.file, e.pos.line, e.pos.col, "<yaml>", e.message, e.fix)])


def load_spec_file(path: Path) -> LoadedSpec:
    """Load and validate a resource spec file (``nodeops.spec.loading.load_spec`` also takes an
    Ansible inventory). Raises :class:`SpecError` (exit 2) on any problem."""
    try:
        return validate_located(load_file(path))
    except YamlSyntaxError as e:
        raise _syntax_issue(e) from None


def load_spec_text(text: str, file: str = "<string>") -> LoadedSpec:
    try:
        return validate_located(load_text(text, file))
    except YamlSyntaxError as e:
        raise _syntax_issue(e) from None
