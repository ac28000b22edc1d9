"""The preflight's rules that need no spec: the Python env, the runner's commands, the workdir,
the script, and parity with the chief. Stdlib only: ``check`` judges with them on the controller,
and a Slurm job's first step (the preflight inside the allocation, see ``nodeops.backends.slurm.job``) ships
this file's source and judges with the same functions on the batch node, where nodeops is not
installed. :func:`gate` is that step's entry point.
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

OK, WARN, FAIL = "ok", "warn", "fail"
# ``python3 -c GATE_BOOT PAYLOAD PROBE_OUTPUT RUN_DIR NODE...`` on a Slurm job's batch node: this
# file's source comes in the payload; a module of its own, so that its dataclass resolves.
GATE_BOOT = (
    "import json,sys,types;d=json.load(open(sys.argv[1]));m=types.ModuleType('nodeops_check_rules');"
    "sys.modules[m.__name__]=m;exec(compile(d['rules'],'nodeops-check-rules','exec'),m.__dict__);"
    "m.gate_main(sys.argv[1:])"
)
PARITY = ("python", "torch", "torch_cuda", "nccl", "driver")  # compared across nodes, besides packages
PREFLIGHT_ERRORS = "preflight-errors"  # in a Slurm run dir: each node's stderr in the preflight step (NODE.err)

# What each runner needs on a node beyond the Python env, and where it comes from. mpirun starts
# Open MPI's daemons on every node; DeepSpeed's runner (on the chief) fans out with pdsh.
RUNNER_COMMANDS: dict[str, dict[str, tuple[str, bool]]] = {
    "torchrun": {},
    "mpirun": {"mpirun": ("openmpi-bin, which setup installs (`nodeops setup SPEC --tags packages`); on Slurm "
                          "nodes, the cluster's Open MPI (a module the env file loads, say)", False)},
    "deepspeed": {"deepspeed": ("the deepspeed package: add it to python.packages and run setup", True),
                  "pdsh": ("pdsh, which setup installs (`nodeops setup SPEC --tags packages`)", True)},
}  # fmt: skip


@dataclass(frozen=True)
class Row:
    host: str
    check: str
    status: str  # ok | warn | fail
    detail: str


def runner_commands(runner: str, chief: bool) -> list[str]:
    """The commands the runner needs on this node (the chief's only, where flagged)."""
    return sorted(c for c, (_, chief_only) in RUNNER_COMMANDS.get(runner, {}).items() if chief or not chief_only)


def slurm_runner_commands(runner: str) -> list[str]:
    """The commands every node of a Slurm job needs: there each node runs the runner's own
    launcher (DeepSpeed's per-node one too), and nothing fans out over ssh (no pdsh)."""
    return [c for c in runner_commands(runner, True) if c != "pdsh"]


def shown(value: Any, missing: str = "unknown") -> str:
    """A parity value as text: never the string 'None'."""
    return missing if value is None or value == "" else str(value)


def _reference(values: dict[str, str], chief: str) -> str | None:
    if chief in values:
        return values[chief]
    common = Counter(values.values()).most_common(1)
    return common[0][0] if common else None


def env_rows(h: str, env: dict[str, Any], runner: str, v: dict[str, str]) -> list[Row]:
    """The Python env as the job gets it (env.sh, then the activation): python, torch, and the
    runner's own commands; fills ``v`` with this host's parity values."""
    rows: list[Row] = []
    if "error" in env:
        return [Row(h, "python env", FAIL, f"activation failed: {env['error']}")]
    where = env.get("env_prefix") or env.get("executable", "")
    rows.append(Row(h, "python env", OK, f"python {env.get('python')} in {where}"))
    v["python"] = shown(env.get("python"))
    if "torch" in env:
        v["torch"] = str(env["torch"])
        v["torch_cuda"] = shown(env.get("torch_cuda"), "none (CPU build)")
        v["nccl"] = shown(env.get("nccl"), "none")
    else:
        status = FAIL if runner in ("torchrun", "deepspeed") else WARN
        rows.append(Row(h, "torch", status, f"cannot import torch: {env.get('torch_error', '?')}"))
    for cmd, path in sorted((env.get("commands") or {}).items()):
        source = RUNNER_COMMANDS.get(runner, {}).get(cmd, ("", False))[0]
        if path:
            rows.append(Row(h, "runner", OK, f"{cmd}: {path}"))
        else:
            why = f"launch.runner {runner} needs {cmd}, not found after env.sh and the env's activation"
            rows.append(Row(h, "runner", FAIL, f"{why}; it comes with {source}"))
    return rows


def workdir_rows(h: str, f: dict[str, Any], workdir: str, v: dict[str, str]) -> list[Row]:
    """The workdir (there, and the same as the source) and the script in it."""
    rows: list[Row] = []
    wd = f.get("workdir")
    if wd is not None:
        if not wd.get("exists"):
            rows.append(Row(h, "workdir", FAIL, f"{workdir} does not exist; run `nodeops setup`"))
        elif "manifest" in wd:
            m = wd["manifest"]
            src = m.get("source") or "the source"
            if m.get("same"):
                rows.append(Row(h, "workdir", OK, str(m.get("summary"))))
            else:
                rows.append(Row(h, "workdir", FAIL, f"differs from {src} on this machine: {m.get('summary')}; "
                                                    "run `nodeops setup SPEC --tags shared_path`, or launch with "
                                                    "--sync"))  # fmt: skip
        elif "hash" in wd:
            v["workdir hash"] = str(wd["hash"])
    sc = f.get("script")
    if sc is not None and not sc.get("exists"):
        why = "the script must be in the workdir (in the source, for an rsync workdir) or a path on every node"
        rows.append(Row(h, "script", FAIL, f"{sc.get('path')} does not exist here; {why}"))
    return rows


def parity_rows(chief: str, facts: dict[str, dict[str, Any]], values: dict[str, dict[str, str]],
                fast: bool) -> list[Row]:  # fmt: skip
    """Versions, packages (and, in full checks, the workdir hash) against the chief's; with no
    ``chief`` (a Slurm allocation), against what most nodes have."""
    rows: list[Row] = []
    there, ref_name = (f"on the chief {chief}", "the chief") if chief else ("on most nodes", "most nodes")
    keys = [*PARITY] + ([] if fast else ["workdir hash"])
    for key in keys:
        have = {h: vals[key] for h, vals in values.items() if key in vals}
        ref = _reference(have, chief)
        for h, val in have.items():
            if h != chief and ref is not None and val != ref:
                hint = "; re-run `nodeops setup` to sync it" if key == "workdir hash" else ""
                rows.append(Row(h, key, FAIL, f"{val} here, {ref} {there}{hint}"))
            elif key in ("torch", "workdir hash") and val == ref:
                rows.append(Row(h, key, OK, f"{val} (same as {ref_name})" if h != chief else val))
    pkgs = {h: f.get("env", {}).get("packages") for h, f in facts.items() if f.get("env", {}).get("packages")}
    if chief in pkgs or not pkgs:
        ref_pk = pkgs.get(chief)
    else:
        common = Counter(json.dumps(pk, sort_keys=True) for pk in pkgs.values()).most_common(1)[0][0]
        ref_pk = json.loads(common)
    short = "chief" if chief else "most"
    differing: set[str] = set()
    for h, pk in pkgs.items():
        if h == chief or ref_pk is None:
            continue
        diffs = sorted(n for n in set(pk) | set(ref_pk) if pk.get(n) != ref_pk.get(n))
        if diffs:
            listed = ", ".join(f"{n} {pk.get(n, 'missing')} ({short} {ref_pk.get(n, 'missing')})" for n in diffs[:5])
            more = f" and {len(diffs) - 5} more" if len(diffs) > 5 else ""
            rows.append(Row(h, "packages", FAIL, f"{len(diffs)} differ from {ref_name}: {listed}{more}"))
            differing.update(diffs)
        else:
            rows.append(Row(h, "packages", OK, f"{len(pk)} installed, same as {ref_name}"))
    for h, pk in pkgs.items():  # the diff table shows every host's version of a package that differs
        for n in differing:
            values.setdefault(h, {})[f"pkg {n}"] = pk.get(n, "missing")
    return rows


def fast_rows(facts: dict[str, dict[str, Any]], chief: str, runner: str, workdir: str) -> list[Row]:
    """The preflight's fast subset for nodes known only by their facts (a Slurm allocation): per
    node its env and workdir rows, then parity with ``chief``; nodes in ``facts``' order."""
    values: dict[str, dict[str, str]] = {}
    rows: list[Row] = []
    for h, f in facts.items():
        v = values.setdefault(h, {})
        rows += env_rows(h, f.get("env", {}), runner, v)
        rows += workdir_rows(h, f, workdir, v)
    rows += parity_rows(chief, facts, values, True)
    order = {h: i for i, h in enumerate(facts)}
    return sorted(rows, key=lambda r: order.get(r.host, 0))


def gate(expect: dict[str, Any], documents: Callable[[str], list[dict[str, Any]]], output: str,
         nodes: list[str]) -> int:  # fmt: skip
    """A Slurm job's preflight step, judged on the batch node: the probe's ``output`` (one
    document per node), the allocation's ``nodes`` (the first is the reference), ``expect``'s
    runner and workdir. Prints every failing row (``nodeops: preflight: HOST: CHECK: DETAIL``)
    and writes ``preflight.json`` (every row) into ``expect["out"]``; 0 when nothing failed."""
    facts = {str(d.get("slurm_node") or d.get("hostname")): d for d in documents(output)}
    missing = [n for n in nodes if n not in facts]
    ordered = {**{n: facts[n] for n in nodes if n in facts}, **{h: f for h, f in facts.items() if h not in nodes}}
    srun = int(expect.get("srun_exit") or 0)
    why = ("" if not srun else "; the step timed out" if srun in (124, 137)
           else f"; srun exited {srun} (its error is in the batch log)")  # fmt: skip
    rows = []
    for n in missing:
        own = _own_error(os.path.join(expect["out"], PREFLIGHT_ERRORS, f"{n}.err"))
        said = why.replace(" (its error is in the batch log)", "") + f": {own}" if own else why
        rows.append(Row(n, "probe", FAIL, f"no answer from the preflight's srun task on this node{said}"))
    # parity against what most nodes have (no chief on Slurm: the first node may be the odd one)
    rows += fast_rows(ordered, "", expect["runner"], expect["workdir"])
    failed = [r for r in rows if r.status == FAIL]
    with open(os.path.join(expect["out"], "preflight.json"), "w") as fh:
        json.dump({"status": FAIL if failed else OK, "hosts": list(ordered) + missing,
                   "rows": [asdict(r) for r in rows]}, fh)  # fmt: skip
    for r in failed:
        print(f"nodeops: preflight: {r.host}: {r.check}: {r.detail}", flush=True)
    return 1 if failed else 0


def _own_error(path: str) -> str:
    """A node's own error, from its task's stderr in the preflight step (srun --error, one file
    per node): its last line, e.g. 'slurmstepd: error: execve(): python3: No such file or directory'."""
    try:
        with open(path, errors="replace") as fh:
            lines = [line.strip() for line in fh.read().splitlines() if line.strip()]
    except OSError:
        return ""
    return lines[-1][:300] if lines else ""


def gate_main(argv: list[str]) -> None:
    """``PAYLOAD PROBE_OUTPUT RUN_DIR SRUN_EXIT NODE...`` (see :data:`GATE_BOOT`): the payload holds the
    probe's and this file's source and ``expect``; the probe's own ``documents`` reads its frames."""
    with open(argv[0]) as fh:
        d = json.load(fh)
    try:
        with open(argv[1], errors="replace") as fh:
            output = fh.read()
    except OSError:
        output = ""
    g: dict[str, Any] = {"__name__": "nodeops_probe"}
    exec(compile(d["source"], "nodeops-probe", "exec"), g)
    sys.exit(gate(dict(d["expect"], out=argv[2], srun_exit=argv[3]), g["documents"], output, argv[4:]))
