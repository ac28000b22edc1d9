"""DeepSpeed's hostfile and ``.deepspeed_env`` formats, as DeepSpeed's launcher reads them.

The rules follow ``tests/data/peers/deepspeed/CASES.md`` (H1-H12, E4-E6). Where DeepSpeed is lax
in a way that hurts (non-ASCII digits, H12) we are stricter; everything DeepSpeed accepts
otherwise, we accept with the same result.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from nodeops.errors import SpecError, SpecIssue
from nodeops.spec.model import ENV_NAME

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


# ``python3 -I -c ENV_FILE_BOOT`` in a Slurm job (runner deepspeed): the ``.deepspeed_env`` files
# DeepSpeed's runner reads (``DS_ENV_FILE``'s name, default ``.deepspeed_env``, in the home then
# in the current dir; a later value replaces an earlier one in its first place) as the
# ``export K=V`` lines its pdsh runner sends each node's shell (:func:`export_fragment`, E6),
# which each node's task then evals. Ends the job (exit 1, naming the file and line) on a line
# without ``=`` (DeepSpeed crashes on it, E4/E5), a name that is no shell name, a value DeepSpeed's
# unescaped double quotes would break (:func:`env_file_problem`), or bytes that are not UTF-8.
ENV_FILE_BOOT = (
    f"BARE, UNSAFE, NAME = {_DS_BARE.pattern!r}, {_DS_UNSAFE.pattern!r}, {ENV_NAME.pattern!r}\n"
    + r"""
import os, re, sys
name = os.environ.get("DS_ENV_FILE", ".deepspeed_env")
out = {}
for d in (os.path.expanduser("~"), "."):
    p = os.path.join(d, name)
    if not os.path.isfile(p):
        continue
    try:
        with open(p, encoding="utf-8-sig") as fh:
            lines = fh.readlines()
    except (OSError, UnicodeError) as e:
        sys.exit(f"nodeops: deepspeed: cannot read {os.path.abspath(p)}: {e}")
    for n, line in enumerate(lines, 1):
        where = f"nodeops: deepspeed: {os.path.abspath(p)} line {n}: "
        if "=" not in line:
            sys.exit(where + f"{line.rstrip()!r} has no '=' (DeepSpeed's runner stops on it)")
        k, v = (part.strip() for part in line.split("=", 1))
        k = k[len("export "):].strip() if k.startswith("export ") else k
        if not re.match(NAME, k):
            sys.exit(where + f"{k!r} is not an environment variable name")
        if re.search(UNSAFE, v):
            sys.exit(where + f"{k}: DeepSpeed wraps values in double quotes without escaping, so \", ` and \\ break it")
        out[k] = v
for k, v in out.items():
    print(f"export {k}={v}" if re.match(BARE, v) else f'export {k}="{v}"')
"""
)

# ``python3 -I -c WORLD_INFO_BOOT NODE=COUNT=IDS...`` in a Slurm job (runner deepspeed): DeepSpeed's
# ``--world_info`` (urlsafe base64 of ``{node: [device ids]}``, in node-rank order) from each
# node's GPU count and the ids in its ``CUDA_VISIBLE_DEVICES`` (0..COUNT-1 where they do not match).
WORLD_INFO_BOOT = r"""
import base64, json, sys
world = {}
for arg in sys.argv[1:]:
    node, count, ids = arg.split("=", 2)
    got = [i for i in ids.split(",") if i]
    got = got if len(got) == int(count) else [str(i) for i in range(int(count))]
    world[node] = [int(i) if i.isdigit() else i for i in got]
print(base64.urlsafe_b64encode(json.dumps(world).encode()).decode())
"""
