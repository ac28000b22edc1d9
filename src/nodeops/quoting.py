"""One quoting function per target. Every renderer uses these, and nothing else, to put a spec
string into a file or a command that another parser reads.

| target | function | what the parser then sees |
|---|---|---|
| bash, one word | :func:`sh_word` | exactly the string (no expansion of any kind) |
| bash, a path that may start with ``~/`` | :func:`sh_path` | the path, ``~`` as the remote ``$HOME`` |
| bash, a ``shared_envs`` value | :func:`sh_expand` | ``$NAME``/``${NAME}`` expanded, the rest literal |
| rsync's ``-e`` command, one word | :func:`rsync_rsh_word` | exactly the string (rsync splits ``-e`` itself) |
| ssh_config | :func:`ssh_config_value` | exactly the string (``%`` escaped where ssh expands tokens) |
| /etc/fstab | (validate) | ``ansible.posix.mount`` writes it; NFS fields need no escaping |
| Ansible (inventory, extra vars) | :func:`ansible_yaml` | exactly the string, never templated (``!unsafe``) |

Each either quotes or raises :class:`QuotingError` for what the target cannot carry (a NUL in a
bash word, a line break in ssh_config). ``validate`` refuses such values earlier, with a line
number; these checks are the last line of defence, not the user-facing error.

The bash functions live in the collection (``plugins/module_utils/nodeops_shell.py``), stdlib only,
so the roles' filters need no nodeops package on the controller.
"""

from __future__ import annotations

import functools
import re
import shlex
from collections.abc import Callable
from typing import Any

import yaml

from nodeops import _shell
from nodeops.errors import NodeopsError

__all__ = [
    "QuotingError",
    "ansible_yaml",
    "expand_refs",
    "rsync_rsh_word",
    "sh_expand",
    "sh_path",
    "sh_run_word",
    "sh_word",
    "ssh_config_value",
]


class QuotingError(NodeopsError, ValueError):
    """A value the target cannot carry. validate refuses these first; if one gets past it, this is
    still a clear error with exit 2, never a traceback."""

    exit_code = 2


# --------------------------------------------------------------------------- bash
# The bash functions are the collection's plugins/module_utils/nodeops_shell.py (nodeops/_shell.py
# links to it), so the roles' filters and the launch role's templates quote with the same code.
def _bash(fn: Callable[[object], str]) -> Callable[[object], str]:
    @functools.wraps(fn)
    def wrapped(value: object) -> str:
        try:
            return fn(value)
        except _shell.ShellQuotingError as e:
            raise QuotingError(str(e)) from None

    return wrapped


sh_word = _bash(_shell.sh_word)
sh_path = _bash(_shell.sh_path)
sh_expand = _bash(_shell.sh_expand)
sh_run_word = _bash(_shell.sh_run_word)
rsync_rsh_word = _bash(_shell.rsync_rsh_word)
expand_refs = _shell.expand_refs


# --------------------------------------------------------------------------- ssh_config
_SSH_BAD = re.compile(r"[^\x20-\x7e]")  # control characters and non-ASCII


def ssh_config_value(value: str, *, tokens: bool = False) -> str:
    """A value for one ssh_config directive that ssh reads back as exactly ``value``.

    Control characters and non-ASCII cannot be carried (ssh_config has no escape for a line
    break, and ssh mangles non-ASCII) and raise, as does an empty value. Anything with
    whitespace, a quote, a backslash, ``#`` or ``=`` is double-quoted, with backslash, ``"`` and
    ``'`` backslash-escaped as OpenSSH's argv_split reads them.
    ``tokens``: the directive expands ``%x`` tokens (IdentityFile, UserKnownHostsFile, ...), so
    ``%`` becomes ``%%``.
    """
    if value == "" or _SSH_BAD.search(value):
        raise QuotingError(f"ssh_config: {value!r} is empty or holds a control character or non-ASCII")
    if tokens:
        value = value.replace("%", "%%")
    if any(c.isspace() or c in "#'\"=\\" for c in value):
        escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("'", "\\'")
        return f'"{escaped}"'
    return value


# --------------------------------------------------------------------------- Ansible
# libyaml's emitter and parser where PyYAML has them (its wheels do): the same YAML, several
# times faster (a 1,000-node inventory; bench/render_bench.py). The representers stay in Python.
_SafeDumper: type[yaml.SafeDumper] = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
SafeLoader: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class _AnsibleDumper(_SafeDumper):  # type: ignore[valid-type,misc]
    pass


def _represent_str(dumper: yaml.SafeDumper, data: str) -> yaml.Node:
    # Jinja acts only on "{{", "{%" and "{#": a string without "{" is inert, and stays plain so
    # that the rendered inventory reads as usual. Everything else is tagged !unsafe.
    if "{" in data:
        return dumper.represent_scalar("!unsafe", str(data), style="'" if "\n" not in data else '"')
    return dumper.represent_str(str(data))


_AnsibleDumper.add_representer(str, _represent_str)


def ansible_yaml(data: Any, **kw: Any) -> str:
    """YAML for Ansible (inventory, extra-vars files) that Ansible reads back as exactly the same
    values and never templates: every string that holds a ``{`` is tagged ``!unsafe``, so
    ``{{ ... }}`` or ``{% ... %}`` in a spec value stays text wherever the variable is used.
    (Mapping keys are names that validate restricts, so they never hold ``{`` and stay plain.)"""
    kw.setdefault("sort_keys", False)
    kw.setdefault("default_flow_style", False)
    kw.setdefault("width", 1000)
    return str(yaml.dump(data, Dumper=_AnsibleDumper, allow_unicode=True, **kw))


class _AnsibleLoader(SafeLoader):  # type: ignore[valid-type,misc]
    pass


_AnsibleLoader.add_constructor("!unsafe", lambda loader, node: loader.construct_scalar(node))


def load_ansible_yaml(text: str) -> Any:
    """Read YAML written by :func:`ansible_yaml` back (``!unsafe`` strings as plain strings)."""
    return yaml.load(text, Loader=_AnsibleLoader)


def ssh_args_options(args: str) -> dict[str, str]:
    """The ssh options in an Ansible ``ansible_ssh_common_args``/``ansible_ssh_extra_args`` string
    that decide how a host is reached: ``-o Key=Value`` / ``-o Key Value`` / ``-oKey=Value``,
    ``-J`` (ProxyJump), ``-i`` (IdentityFile), ``-p`` (Port), ``-l`` (User). Keys are OpenSSH's canonical
    spelling, lowercased; the first of each wins, as in ssh."""

    out: dict[str, str] = {}
    words = shlex.split(args)
    flags = {"-J": "proxyjump", "-i": "identityfile", "-p": "port", "-l": "user"}
    i = 0
    while i < len(words):
        w = words[i]
        key, value = "", ""
        if w == "-o" and i + 1 < len(words):
            key, _, value = words[i + 1].replace("=", " ", 1).partition(" ")
            i += 1
        elif w.startswith("-o") and len(w) > 2:
            key, _, value = w[2:].replace("=", " ", 1).partition(" ")
        elif w in flags and i + 1 < len(words):
            key, value = flags[w], words[i + 1]
            i += 1
        elif w[:2] in flags and len(w) > 2:  # -lml, -p2222: ssh takes the value attached too
            key, value = flags[w[:2]], w[2:]
        if key:
            out.setdefault(key.strip().lower(), value.strip())
        i += 1
    return out
