"""``gpus: auto``: each node's GPUs as nvidia-smi lists them, discovered by ``setup``.

``setup`` asks every ``auto`` node over ssh (the controller's own, so it works before the mesh
exists) for ``nvidia-smi --query-gpu=index``, records the answer on the controller in
``~/.nodeops/clusters/<cluster>/gpus.json``, and renders with it (hostfile ``slots=``, the
inventory's ``nodeops_gpus``). ``launch`` and ``check`` read the record: torchrun's
``--nproc-per-node`` and mpirun/DeepSpeed slots are the discovered counts. A node without an
NVIDIA GPU (no nvidia-smi, or none listed) runs 1 process, and ``check`` says so.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import tempfile
from pathlib import Path

from nodeops.errors import NodeopsError, SpecError
from nodeops.resources import nodeops_home
from nodeops.setup.render import ssh_config
from nodeops.spec.model import LoadedSpec
from nodeops.transport import fan_out, last_line, ssh_argv

# 127: no nvidia-smi (no NVIDIA GPU or driver: 1 process); any other failure (a driver that does
# not answer) is an error to fix, never "no GPU"
QUERY = "command -v nvidia-smi >/dev/null 2>&1 || exit 127; nvidia-smi --query-gpu=index --format=csv,noheader 2>&1"


class DiscoveryError(NodeopsError):
    pass


def auto_nodes(loaded: LoadedSpec) -> list[str]:
    s = loaded.spec
    return [s.alias(n) for n in s.ranked_nodes() if n.gpus == "auto"]


def record_path(loaded: LoadedSpec) -> Path:
    base = nodeops_home()
    return base / "clusters" / loaded.cluster_name / "gpus.json"


def parse(out: str) -> list[int] | None:
    """nvidia-smi's index column (one per line): the ids; None when it printed something else."""
    ids = [line.strip() for line in out.splitlines() if line.strip()]
    return sorted(int(i) for i in ids) if all(i.isdigit() for i in ids) else None


def discover(loaded: LoadedSpec, ssh_config: Path, timeout: float = 60) -> dict[str, list[int]]:
    """Ask every ``gpus: auto`` node, in parallel. Raises naming each host that did not answer."""

    def one(host: str) -> list[int] | str:
        try:
            p = subprocess.run(ssh_argv(ssh_config, host, QUERY), capture_output=True, text=True, timeout=timeout,
                               check=False)  # fmt: skip
        except subprocess.TimeoutExpired:
            return f"no answer within {timeout:.0f}s"
        if p.returncode == 127:
            return []  # no nvidia-smi: no NVIDIA GPU here
        ids = parse(p.stdout) if p.returncode == 0 else None
        if ids is not None:
            return ids
        if p.returncode == 255:
            return last_line(p.stderr, "ssh failed")
        return f"nvidia-smi failed (exit {p.returncode}): {last_line(p.stdout + p.stderr, 'no output')}"

    found = fan_out(auto_nodes(loaded), one)
    bad = {h: r for h, r in found.items() if isinstance(r, str)}
    if bad:
        raise DiscoveryError("gpus: auto: could not ask " + "; ".join(f"{h}: {why}" for h, why in bad.items()))
    return {h: r for h, r in found.items() if isinstance(r, list)}


def save(loaded: LoadedSpec, found: dict[str, list[int]]) -> None:
    p = record_path(loaded)
    p.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = p.with_suffix(".tmp")
    tmp.write_text(json.dumps(found, indent=2) + "\n")
    tmp.replace(p)


def resolve(loaded: LoadedSpec, found: dict[str, list[int]]) -> LoadedSpec:
    """The spec with each ``auto`` node's discovered GPU ids (none: it runs 1 process)."""
    s = loaded.spec
    nodes = [n.model_copy(update={"gpus": found.get(s.alias(n), [])}) if n.gpus == "auto" else n for n in s.nodes]
    spec = s.model_copy(update={"nodes": nodes})
    return dataclasses.replace(loaded, spec=spec, discovered_gpus={h: found.get(h, []) for h in auto_nodes(loaded)})


def resolved(loaded: LoadedSpec, required: bool = True) -> LoadedSpec:
    """The spec with the discovered GPUs from the record. ``required``: a missing record (setup
    never ran, or a node was added since) is a spec error naming the nodes; otherwise they
    count 1 process until setup discovers them."""
    auto = auto_nodes(loaded)
    if not auto:
        return loaded
    p = record_path(loaded)
    try:
        raw = json.loads(p.read_text())
    except (OSError, ValueError):
        raw = {}

    def ids(v: object) -> bool:  # a hand-edited record: only lists of distinct non-negative ids count
        return isinstance(v, list) and all(isinstance(i, int) and i >= 0 for i in v) and len(set(v)) == len(v)

    found = {h: v for h, v in (raw.items() if isinstance(raw, dict) else []) if ids(v)}
    missing = [h for h in auto if h not in found]
    if missing and required:
        raise SpecError([loaded.issue(("nodes",), f"gpus: auto on {', '.join(missing)}: not discovered yet "
                                      f"(no record in {p})", "run `nodeops setup` first: it asks nvidia-smi on "
                                      "every node and records the GPUs")])  # fmt: skip
    out = resolve(loaded, found)
    if missing:  # not required: said, and counted as 1 process
        issue = loaded.issue(("nodes",), f"gpus: auto on {', '.join(missing)}: not discovered yet; counted as "
                             "1 process here", "run `nodeops setup` (it asks nvidia-smi)")  # fmt: skip
        out.warnings.append(dataclasses.replace(issue, severity="warning"))
    return out


def setup_discover(loaded: LoadedSpec, only: list[str] | None = None) -> tuple[LoadedSpec, dict[str, list[int]]]:
    """For ``setup``: ask the ``auto`` nodes (those in ``only``, for --limit), merge into the
    record, and return the spec resolved with it, plus what was asked now."""

    ask = [h for h in auto_nodes(loaded) if only is None or h in only]
    if not ask:
        return resolved(loaded, required=False), {}
    with tempfile.TemporaryDirectory(prefix="nodeops-gpus-") as d:
        cfg = Path(d) / "ssh_config"
        cfg.write_text(ssh_config(loaded))
        subset = dataclasses.replace(loaded, spec=loaded.spec.model_copy(update={"nodes": [
            n for n in loaded.spec.nodes if loaded.spec.alias(n) in ask]}))  # fmt: skip
        found = discover(subset, cfg)
    try:
        old = json.loads(record_path(loaded).read_text())
    except (OSError, ValueError):
        old = {}
    save(loaded, {**old, **found})  # other hosts' entries stay (another --group or --limit may use them)
    return resolved(loaded, required=False), found
