"""Filters for the nccl_env role: nodeops' own quoting functions (nodeops.quoting), so env.sh is
quoted by exactly the code that quotes launch's job scripts.

- ``nodeops_sh_word``: one bash word, nothing expands.
- ``nodeops_sh_expand``: an AutoDist shared_envs value: ``$NAME``/``${NAME}`` expand, the rest is literal.
"""

from __future__ import annotations

try:
    from nodeops.quoting import sh_expand, sh_word
except ImportError as e:  # the role used without the nodeops package on the controller
    raise ImportError("the nccl_env role's filters come from the nodeops Python package: pip install nodeops") from e


class FilterModule:
    def filters(self) -> dict[str, object]:
        return {"nodeops_sh_word": sh_word, "nodeops_sh_expand": sh_expand}
