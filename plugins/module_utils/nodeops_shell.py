# SPDX-License-Identifier: Apache-2.0
"""Bash quoting for nodeops: the one function per bash target, stdlib only.

Shared by the collection's filters (``nodeops.cluster.nodeops_sh_word`` ...), the launch role's
templates, and the nodeops Python package (``nodeops.quoting`` imports this file), so env.sh,
job.sh and every command line are quoted by exactly the same code on every path.

| function | what bash then sees |
|---|---|
| ``sh_word`` | exactly the string: nothing expands or splits |
| ``sh_path`` | the path, a leading ``~`` / ``~/`` as the remote ``$HOME`` |
| ``sh_expand`` | an AutoDist ``shared_envs`` value: ``$NAME``/``${NAME}`` expand, the rest is literal |
| ``sh_run_word`` | ``sh_word``, with the reserved token ``@@HOME@@`` as the remote ``"$HOME"`` |
| ``rsync_rsh_word`` | not bash: one word of rsync's ``-e`` command, which rsync splits itself |

Each raises :class:`ShellQuotingError` (a ``ValueError``) for what bash cannot carry (a NUL).
"""

from __future__ import annotations

import re
import shlex

HOME_TOKEN = "@@HOME@@"  # launch paths under the remote user's home (the controller does not know it)


class ShellQuotingError(ValueError):
    pass


def _no_nul(value: str) -> str:
    if "\0" in value:
        raise ShellQuotingError("shell word: a NUL byte cannot be carried")
    return value


def sh_word(value: object) -> str:
    """One bash word that is exactly ``value``: nothing in it expands or splits."""
    return shlex.quote(_no_nul(str(value)))


def sh_path(path: object) -> str:
    """A path as one bash word, with a leading ``~`` or ``~/`` meaning the remote ``$HOME``."""
    text = str(path)
    if text == "~":
        return '"$HOME"'
    if text.startswith("~/"):
        return '"$HOME"/' + sh_word(text[2:]) if text[2:] else '"$HOME"/'
    return sh_word(text)


def sh_run_word(value: object) -> str:
    """``sh_word``, with every ``@@HOME@@`` as ``"$HOME"`` (expanded by the remote shell)."""
    parts = _no_nul(str(value)).split(HOME_TOKEN)
    return '"$HOME"'.join(sh_word(p) if p else "" for p in parts) or "''"


# $NAME or ${NAME}: the only expansion an AutoDist shared_envs value gets.
_REF = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)\}|([A-Za-z_][A-Za-z0-9_]*))")


def expand_refs(value: str) -> list[tuple[str, str]]:
    """Split a shared_envs value into ("lit", text) and ("ref", NAME) parts."""
    parts: list[tuple[str, str]] = []
    pos = 0
    for m in _REF.finditer(value):
        if m.start() > pos:
            parts.append(("lit", value[pos : m.start()]))
        parts.append(("ref", m.group(1) or m.group(2)))
        pos = m.end()
    if pos < len(value):
        parts.append(("lit", value[pos:]))
    return parts


def sh_expand(value: object) -> str:
    """An AutoDist ``shared_envs`` value as one bash word: ``$NAME`` and ``${NAME}`` expand on
    the node (``LD_LIBRARY_PATH: $LD_LIBRARY_PATH:/opt/lib``), everything else is literal.
    Command substitution (``$(...)``, backticks), arithmetic and ``${NAME:-...}`` forms never
    run: they arrive as the characters written (``validate`` refuses them first)."""
    text = _no_nul(str(value))
    out = "".join(f'"${{{text}}}"' if kind == "ref" else shlex.quote(text) for kind, text in expand_refs(text))
    return out or "''"


def rsync_rsh_word(value: object) -> str:
    """One word of the command given to rsync's ``-e``, which rsync splits itself, not bash: on
    spaces, where quotes keep spaces in a word and a quote doubled inside quotes is that quote
    (rsync's ``do_cmd``). Nothing else is special to it."""
    return "'" + _no_nul(str(value)).replace("'", "''") + "'"
