"""DeepSpeed's hostfile and ``.deepspeed_env`` formats, as DeepSpeed's launcher reads them.

The rules follow ``tests/data/peers/deepspeed/CASES.md`` (H1-H12, E4-E6). Where DeepSpeed is lax
in a way that hurts (non-ASCII digits, H12) we are stricter; everything DeepSpeed accepts
otherwise, we accept with the same result.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from nodeops.errors import SpecError, SpecIssue

# H4: one token, whitespace, literal lowercase "slots=", ASCII digits; anything after is ignored.
_HOST_LINE = re.compile(r"^(\S+)\s+slots=([0-9]+)")
# E6: values made only of these characters are exported bare; anything else gets wrapped
# in double quotes with no escaping.
_DS_BARE = re.compile(r"^[\w@%+=:,./-]*$")
# Characters that survive DeepSpeed's unescaped double quoting with their meaning intact.
# `$` is allowed on purpose: AutoDist's shared_envs rely on remote expansion ($LD_LIBRARY_PATH).
_DS_UNSAFE = re.compile(r'["`\\]')


def parse_hostfile(text: str, file: str = "<hostfile>") -> dict[str, int]:
    """Parse a DeepSpeed hostfile into host -> slots, in file order (node rank order, H8)."""
    return {host: slots for host, (slots, _line) in parse_hostfile_lines(text, file).items()}


def parse_hostfile_lines(text: str, file: str = "<hostfile>") -> dict[str, tuple[int, int]]:
    """Like :func:`parse_hostfile`, with the line number of each host: host -> (slots, line)."""
    hosts: dict[str, tuple[int, int]] = {}
    bad: list[SpecIssue] = []  # every bad line at once, not only the first
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()  # H2: also drops \r
        if not line or line.startswith("#"):  # H3
            continue
        m = _HOST_LINE.match(line)
        if m is None:  # H5
            bad.append(SpecIssue(file, lineno, 1, "hostfile", f"bad entry {line!r}",
                                 "write `HOST slots=N` with lowercase slots= and no spaces around '='"))  # fmt: skip
            continue
        host, slots = m.group(1), int(m.group(2))
        if host in hosts:  # H6
            first = hosts[host][1]
            bad.append(SpecIssue(file, lineno, 1, "hostfile", f"multiple entries for {host} (first on line {first})",
                                 "list each host once"))  # fmt: skip
            continue
        hosts[host] = (slots, lineno)
    if bad:
        raise SpecError(bad)
    if not hosts:  # H7
        raise SpecError(
            [
                SpecIssue(
                    file,
                    1,
                    1,
                    "hostfile",
                    "hostfile is empty or has only comments",
                    "add one `HOST slots=N` line per node",
                )
            ]
        )
    return hosts


def render_hostfile(hosts: Mapping[str, int]) -> str:
    return "".join(f"{host} slots={slots}\n" for host, slots in hosts.items())


def parse_env_file(text: str) -> dict[str, str]:
    """Read a ``.deepspeed_env`` as DeepSpeed does (E4/E5), raising where DeepSpeed would crash."""
    out: dict[str, str] = {}
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()  # the final newline ends the last line; it is not a blank line
    for lineno, line in enumerate(lines, start=1):
        if "=" not in line:
            raise ValueError(f"line {lineno}: {line!r} has no '=' (DeepSpeed crashes on it)")
        key, value = line.split("=", 1)
        out[key.strip()] = value.strip()
    return out


def export_fragment(key: str, value: str) -> str:
    """What DeepSpeed's pdsh runner emits for one variable (E6); used to check our files."""
    return f"export {key}={value}; " if _DS_BARE.match(value) else f'export {key}="{value}"; '


def env_file_problem(key: str, value: str) -> str | None:
    """Why ``key=value`` cannot go into ``.deepspeed_env`` unchanged, or None if it can."""
    if _DS_UNSAFE.search(value):
        return 'DeepSpeed wraps values in double quotes without escaping, so ", ` and \\ break the remote command'
    if value != value.strip():
        return "DeepSpeed strips leading and trailing whitespace from values"
    return None


def render_env_file(env: Mapping[str, str]) -> str:
    """``KEY=VALUE`` lines, no comments and no blank lines (DeepSpeed crashes on both, E5)."""
    return "".join(f"{k}={v}\n" for k, v in env.items())
