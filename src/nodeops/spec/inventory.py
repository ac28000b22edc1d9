"""Ansible inventories as nodeops input: every command that takes a spec takes an inventory source.

The source (YAML, INI, TOML, an executable script, or an inventory plugin config) is read by
Ansible's own ``InventoryManager`` and ``VariableManager``, so every plugin and the
``group_vars/``/``host_vars/`` directories beside it work as for ``ansible-playbook``. The hosts of
one group become a resource spec; the mapping is the table in docs/spec.md ("Ansible inventories as input").

The result is validated like a spec file; each error names the host and the variable, and the
file and line Ansible read it from (Ansible 2.19 tags inventory values with their origin).
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import stat
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml

from nodeops.errors import SpecError, SpecIssue
from nodeops.quoting import SafeLoader, ssh_args_options
from nodeops.spec.load import validate_located
from nodeops.spec.yamlpos import Located, Path_, Pos

NODEOPS_VAR = "nodeops"
MAX_GPUS = 64  # a count larger than any machine has is a typo, not a request
# ssh options an inventory may hold that nodeops' own ssh_config would silently drop
UNSUPPORTED_SSH = {"proxycommand", "user", "hostname", "identityagent", "certificatefile"}
SECTIONS = ("name", "python", "workdir", "network", "mesh", "launch", "env")
_ALIAS_BAD = re.compile(r"[^A-Za-z0-9_-]")


def looks_like_inventory(path: Path) -> bool:
    """By content, not by name: a mapping with ``nodes`` is a spec; an executable file, a plugin
    config (``plugin:``), a YAML inventory (groups with hosts/children/vars), or text that is not a
    YAML mapping (INI, TOML) is an Ansible inventory source."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return False
    if path.stat().st_mode & (stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH) and text.startswith("#!"):
        return True  # a dynamic inventory script
    try:
        data = yaml.load(text, Loader=SafeLoader)
    except yaml.YAMLError:
        data = None
        if not re.search(r"^\s*\[[^\]]+\]\s*$", text, re.M):
            return False  # broken YAML, not INI/TOML-like: let the spec loader report it
    if isinstance(data, dict):
        if "nodes" in data:
            return False
        if "plugin" in data:
            return True
        group_keys = {"hosts", "children", "vars"}
        groups = all(v is None or (isinstance(v, dict) and set(v) <= group_keys) for v in data.values())
        return groups and any(isinstance(v, dict) and v for v in data.values())  # else a (broken) spec
    if isinstance(data, str):
        return True  # host lines of an INI inventory without sections (a spec is never a plain string)
    return data is None and bool(re.search(r"^\s*\[[^\]]+\]\s*$", text, re.M))


@contextlib.contextmanager
def _quiet() -> Iterator[io.StringIO]:
    """Ansible's Display writes warnings to stderr: keep them for the error message instead."""
    buf = io.StringIO()
    with contextlib.redirect_stderr(buf), contextlib.redirect_stdout(io.StringIO()):
        yield buf


def _origin(value: Any) -> tuple[str, Pos] | None:
    try:
        from ansible._internal._datatag._tags import Origin  # Ansible >= 2.19; internal, so optional
    except ImportError:
        return None
    tag = Origin.get_tag(value)
    if tag is None or not tag.path:
        return None
    return str(tag.path), Pos(int(tag.line_num or 0), int(getattr(tag, "col_num", None) or 1))


def _plain(value: Any) -> Any:
    """Ansible's tagged values as plain Python values."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    for t in (bool, int, float, str):
        if isinstance(value, t):
            return t(value)
    return value


def _ssh_opts(hv: Mapping[str, Any]) -> dict[str, str]:
    args = " ".join(str(hv.get(k) or "") for k in ("ansible_ssh_common_args", "ansible_ssh_extra_args"))
    try:
        return ssh_args_options(args)
    except ValueError as e:  # unbalanced quotes
        return {"_split_error": str(e)}


def load_inventory(path: Path, group: str | None = None) -> Any:
    """An Ansible inventory source as a validated :class:`~nodeops.spec.model.LoadedSpec`; every
    problem at once (the mapping's and the spec validation's)."""
    located, problems = inventory_located(path, group)
    try:
        loaded = validate_located(located)
    except SpecError as e:
        raise SpecError([*problems, *e.issues]) from None
    if problems:
        raise SpecError(problems)
    return loaded


def inventory_located(path: Path, group: str | None = None) -> tuple[Located, list[SpecIssue]]:
    """The spec data for ``group``'s hosts, with where each value came from, and the problems
    of the mapping itself (two chiefs, a `nodeops` var that differs between hosts)."""
    os.environ.setdefault("ANSIBLE_LOCALHOST_WARNING", "false")
    os.environ.setdefault("ANSIBLE_INVENTORY_UNPARSED_WARNING", "false")
    from ansible.errors import AnsibleError
    from ansible.inventory.manager import InventoryManager
    from ansible.parsing.dataloader import DataLoader
    from ansible.vars.manager import VariableManager

    file = str(path)
    group = group or "all"

    def fail(message: str, fix: str, field: str = "<inventory>") -> SpecError:
        return SpecError([SpecIssue(file, 1, 1, field, message, fix)])

    from ansible.plugins.loader import init_plugin_loader

    with warnings.catch_warnings():  # "already configured" when the process has set it up before
        warnings.simplefilter("ignore")
        init_plugin_loader()  # the collection loader, as the ansible CLIs set it up: plugin configs need it
    loader = DataLoader()
    # group_vars/ and host_vars/ are read beside the inventory (its dir is also the base dir, as
    # a playbook's is for ansible-playbook), never beside wherever nodeops runs
    loader.set_basedir(str(path.resolve().parent))
    with _quiet() as said:
        try:
            inv = InventoryManager(loader=loader, sources=[str(path.resolve())])
        except AnsibleError as e:
            raise fail(f"Ansible could not read the inventory: {e.message}", "fix the inventory") from None
    parsed = "Unable to parse" not in said.getvalue()
    if not parsed:
        why = " ".join(line.strip() for line in said.getvalue().splitlines() if line.strip())[:600]
        raise fail(f"Ansible could not parse it as an inventory source ({why or 'no plugin accepted it'})",
                   "check it with `ansible-inventory -i SOURCE --list`")  # fmt: skip
    if group not in inv.groups:
        raise fail(f"no group {group!r} in the inventory (groups: {', '.join(sorted(inv.groups))})",
                   "give --group one of those", "--group")  # fmt: skip
    hosts = inv.get_hosts(group)
    if not hosts:
        raise fail(f"group {group!r} has no hosts", "add hosts to it, or choose another --group", "--group")
    vm = VariableManager(loader=loader, inventory=inv)
    from ansible.template import Templar

    data: dict[str, Any] = {"nodes": [], "ssh": {}}
    loc = Located(data=data, file=file)
    issues: list[SpecIssue] = []

    def record(spath: Path_, host: str, var: str, value: Any) -> None:
        loc.labels[spath] = f"{host}: {var}"
        o = _origin(value)
        if o is not None:
            loc.files[spath], loc.keys[spath] = o

    hvs: dict[str, dict[str, Any]] = {}
    for h in hosts:
        try:
            with _quiet():
                raw = vm.get_vars(host=h, include_hostvars=False)
        except AnsibleError as e:  # a broken group_vars/host_vars file
            where = _origin(getattr(e, "obj", None))
            mark = getattr(getattr(e, "orig_exc", None), "problem_mark", None)  # a YAML error: where it is
            if where is None and mark is not None and str(getattr(mark, "name", "")).startswith("/"):
                where = (str(mark.name), Pos(int(mark.line) + 1, int(mark.column) + 1))
            wfile, wpos = where if where else (file, Pos(0, 0))
            raise SpecError(
                [
                    SpecIssue(
                        wfile,
                        wpos.line,
                        wpos.col,
                        f"{h.name}: variables",
                        f"Ansible could not read them: {e.message}",
                        "fix that file",
                    )
                ]
            ) from None
        with _quiet():
            templar = Templar(loader=loader, variables=raw)
            hv: dict[str, Any] = {}
            for k in raw:
                if k.startswith("ansible_") or k.startswith(NODEOPS_VAR):
                    v = raw[k]
                    try:  # templated as Ansible would (a lookup in a value runs here, on the controller)
                        hv[k] = templar.template(v) if "{{" in repr(_plain(v)) else v
                    except AnsibleError as e:
                        issues.append(_issue(file, v, f"{h.name}: {k}", f"cannot be templated: {e.message}",
                                             "fix the value (nodeops reads the inventory without facts)"))  # fmt: skip
                        hv[k] = v
        hvs[h.name] = hv

    # nodeops' own sections: one `nodeops` var, the same for every host
    sections: dict[str, Any] = {}
    first_with: str | None = None
    for name, hv in hvs.items():
        if NODEOPS_VAR not in hv:
            continue
        value = hv[NODEOPS_VAR]
        if not isinstance(value, Mapping):
            issues.append(_issue(file, value, f"{name}: {NODEOPS_VAR}",
                                 f"must be a mapping of spec sections ({', '.join(SECTIONS)})",
                                 "write it as in a spec, e.g. nodeops: {python: {venv: ~/.venvs/train}}"))  # fmt: skip
            continue
        if first_with is None:
            first_with, sections = name, dict(value)
        elif _plain(value) != _plain(sections):
            issues.append(_issue(file, value, f"{name}: {NODEOPS_VAR}",
                                 f"differs from {first_with}'s; nodeops settings are cluster-wide",
                                 "set `nodeops` once, in group_vars of the group (or all)"))  # fmt: skip
    wd = _plain(sections.get("workdir"))
    if isinstance(wd, dict) and wd.get("sync", "rsync") == "rsync" and not wd.get("source"):
        # a spec's default source is its own directory; an inventory's would copy the infra repo
        issues.append(_issue(file, sections["workdir"], f"{first_with}: {NODEOPS_VAR}.workdir.source",
                             "required with an Ansible inventory (rsync copies it to every node)",
                             "set it to your training project's directory on this machine"))  # fmt: skip
    for key, value in sections.items():
        data[key] = _plain(value)
        assert first_with is not None
        _record_tree(loc, (key,), value, first_with, f"{NODEOPS_VAR}.{key}")
        if key not in SECTIONS:
            loc.labels[(key,)] = f"{first_with}: {NODEOPS_VAR}.{key}"

    # chief
    chief_group = [h.name for h in inv.get_hosts("chief")] if "chief" in inv.groups else []
    chief_group = [h for h in chief_group if h in hvs]
    flagged = []
    for h, hv in hvs.items():
        if hv.get("nodeops_chief") is None:
            continue
        flag = _bool(hv["nodeops_chief"])
        if flag is None:
            issues.append(_issue(file, hv["nodeops_chief"], f"{h}: nodeops_chief", f"{_plain(hv['nodeops_chief'])!r} "
                                 "is not a boolean", "write true or false"))  # fmt: skip
        elif flag:
            flagged.append(h)
    if len(chief_group) > 1:
        issues.append(SpecIssue(file, 0, 0, "chief", f"group `chief` holds {len(chief_group)} hosts of "
                                f"{group!r}: {', '.join(chief_group)}",
                                "leave exactly one host in group chief"))  # fmt: skip
    elif not chief_group and len(flagged) > 1:
        issues.append(SpecIssue(file, 0, 0, "nodeops_chief", f"{len(flagged)} hosts have nodeops_chief: true: "
                                f"{', '.join(flagged)}", "set it on exactly one host"))  # fmt: skip
    chief = (chief_group or flagged or [hosts[0].name])[0]

    # nodes and their ssh groups
    groups: dict[tuple[Any, ...], str] = {}
    for i, (name, hv) in enumerate(hvs.items()):
        opts = _ssh_opts(hv)
        for legacy in ("host", "user", "port"):  # Ansible's older ansible_ssh_* spellings
            if hv.get(f"ansible_{legacy}") is None and hv.get(f"ansible_ssh_{legacy}") is not None:
                hv[f"ansible_{legacy}"] = hv[f"ansible_ssh_{legacy}"]
        conn_kind = str(_plain(hv.get("ansible_connection") or "ssh"))
        if conn_kind not in ("ssh", "smart", "paramiko", "paramiko_ssh", "ansible.builtin.ssh"):
            issues.append(_issue(file, hv.get("ansible_connection"), f"{name}: ansible_connection",
                                 f"{conn_kind!r}: nodeops reaches every host over ssh",
                                 "leave this host out (--group), or give it an ssh connection"))  # fmt: skip
        for bad in sorted(set(opts) & UNSUPPORTED_SSH):
            issues.append(_issue(file, hv.get("ansible_ssh_common_args") or hv.get("ansible_ssh_extra_args"),
                                 f"{name}: ansible_ssh_common_args", f"ssh option {bad!r} is not carried over "
                                 "(nodeops writes its own ssh_config)", "use ansible_user / ProxyJump (-J) "
                                 "instead, or a spec for this cluster"))  # fmt: skip
        if "_split_error" in opts:
            issues.append(
                _issue(
                    file,
                    hv.get("ansible_ssh_common_args"),
                    f"{name}: ansible_ssh_common_args",
                    f"cannot be split like a shell line ({opts['_split_error']})",
                    "balance the quotes",
                )
            )
        node: dict[str, Any] = {"address": _plain(hv.get("ansible_host") or name)}
        if hv.get("ansible_host"):
            record(("nodes", i, "address"), name, "ansible_host", hv.get("ansible_host"))
        else:
            loc.labels[("nodes", i, "address")] = f"{name}: the inventory name (no ansible_host)"
        loc.labels[("nodes", i)] = name
        alias = name if not _ALIAS_BAD.search(name) else None
        if alias is None and "." in name and not _ALIAS_BAD.search(name.split(".")[0]):
            alias = name.split(".")[0]  # gpu1.example.com -> gpu1
        if alias and alias != node["address"]:
            node["name"] = alias
        if name == chief:
            node["chief"] = True
        gpus = hv.get("nodeops_gpus")
        for var, field_ in (("nodeops_nproc", "nproc"), ("nodeops_socket_ifname", "socket_ifname")):
            if hv.get(var) is not None:  # what `nodeops render` writes per host: a round trip keeps them
                node[field_] = _plain(hv[var])
                record(("nodes", i, field_), name, var, hv[var])
        if gpus is not None:
            g = _plain(gpus)
            if isinstance(g, int) and not isinstance(g, bool) and not 0 <= g <= MAX_GPUS:
                issues.append(_issue(file, gpus, f"{name}: nodeops_gpus", f"{g} GPUs on one host",
                                     f"give a count from 0 to {MAX_GPUS}, a list of ids, or auto"))  # fmt: skip
                g = []
            node["gpus"] = list(range(g)) if isinstance(g, int) and not isinstance(g, bool) else g
            record(("nodes", i, "gpus"), name, "nodeops_gpus", gpus)
        else:
            node["cpus"] = [0]
        key_file = (hv.get("ansible_ssh_private_key_file") or hv.get("ansible_private_key_file")
                    or opts.get("identityfile"))  # fmt: skip
        known: Any = hv.get("ansible_ssh_known_hosts_file")
        known_var = "ansible_ssh_known_hosts_file" if known else "ansible_ssh_common_args"
        known = known or opts.get("userknownhostsfile")
        checking = str(opts.get("stricthostkeychecking", "yes")).lower()
        if str(_plain(known or "")) in ("/dev/null", "none") or checking in ("no", "off", "false"):
            # host key checking off in the inventory: nodeops pins on first use (accept-new) in the
            # user's known_hosts instead of accepting every key every time
            known, checking = (None if str(_plain(known or "")) in ("/dev/null", "none") else known), "accept-new"
        ssh = {"username": _plain(hv.get("ansible_user")), "port": _plain(hv.get("ansible_port") or opts.get("port")),
               "key_file": _abs(_plain(key_file)) if key_file else None,
               "known_hosts": _abs(_plain(known)) if known else None,
               "proxy_jump": opts.get("proxyjump") or None,
               "host_key_checking": "yes" if checking in ("yes", "true", "ask") else "accept-new"}  # fmt: skip
        ssh = {k: v for k, v in ssh.items() if v is not None and not (k == "host_key_checking" and v == "yes")}
        sig = tuple(sorted((k, repr(v)) for k, v in ssh.items()))
        if sig not in groups:
            groups[sig] = f"inv{len(groups) + 1}"
            gname = groups[sig]
            data["ssh"][gname] = ssh
            for field_, var, value in (
                ("username", "ansible_user", hv.get("ansible_user")),
                ("port", "ansible_port", hv.get("ansible_port")),
                ("key_file", "ansible_ssh_private_key_file", key_file),
                ("known_hosts", known_var, known),
                ("proxy_jump", "ansible_ssh_common_args", hv.get("ansible_ssh_common_args")),
            ):
                record(("ssh", gname, field_), name, var, value)
        node["ssh_config"] = groups[sig]
        data["nodes"].append(node)
    loc.data = _plain(data)  # Ansible's tagged str/int/dict as plain values
    return loc, sorted(issues, key=lambda x: (x.file, x.line))


def _issue(file: str, value: Any, field: str, message: str, fix: str) -> SpecIssue:
    """An issue at a variable's origin (the inventory file when Ansible gives none)."""
    o = _origin(value)
    if o is None:
        return SpecIssue(file, 0, 0, field, message, fix)
    return SpecIssue(o[0], o[1].line, o[1].col, field, message, fix)


def _bool(value: Any) -> bool | None:
    """Ansible's boolean reading (INI gives strings: true, yes, 1, on, ...); None when it is not one."""
    from ansible.module_utils.parsing.convert_bool import boolean

    try:
        return bool(boolean(_plain(value), strict=True))
    except TypeError:
        return None


def _abs(p: Any) -> str:
    """A controller path as Ansible uses it: relative to the current directory (``~`` is kept; the
    spec expands it)."""
    text = str(p)
    return text if text.startswith("~") or os.path.isabs(text) else os.path.abspath(text)


def _record_tree(loc: Located, spath: Path_, value: Any, host: str, var: str) -> None:
    """Where each value of the `nodeops` var came from, for errors inside it."""
    loc.labels[spath] = f"{host}: {var}"
    o = _origin(value)
    if o is not None:
        loc.files[spath], loc.keys[spath] = o
    if isinstance(value, Mapping):
        for k, v in value.items():
            _record_tree(loc, (*spath, str(k)), v, host, f"{var}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _record_tree(loc, (*spath, i), v, host, f"{var}[{i}]")


def spec_text(path: Path, group: str | None = None) -> str:
    """``nodeops import-inventory``: the inventory's hosts as a resource spec file (validated
    first, so what is written loads)."""
    loaded = load_inventory(path, group)  # every problem, as for any command (a script runs once)
    located = loaded.located
    head = (f"# Resource spec imported by nodeops from the Ansible inventory {path}"
            + (f" (group {group})" if group else "") + ".\n")  # fmt: skip
    return head + yaml.safe_dump(located.data, sort_keys=False, default_flow_style=None, width=100)
