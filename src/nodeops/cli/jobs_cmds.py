"""`nodeops status`, `logs`, `stop`, `stacks`, `runs`, `clean`: find a launched run again by its id."""

from __future__ import annotations

import json
import re
import time
from collections import deque
from typing import Annotated, Any

import typer

from nodeops.cli.app import ConsoleSink, app, err, errors, fail
from nodeops.errors import EXIT_FAILURE, EXIT_SPEC
from nodeops.lifecycle import control
from nodeops.lifecycle import runs as R
from nodeops.node import stacks as S
from nodeops.setup.runner import runs_dir

RunArg = Annotated[
    str | None,
    typer.Argument(
        metavar="RUN",
        help="A run id printed by `nodeops launch`, or a spec file: its latest run (`stop`: its live one). "
        "Default: the latest run launched here (named on stderr); `stop` without one acts only when one run "
        "is live.",
        show_default=False,
    ),
]


@app.command(
    epilog="Examples:\n\n    nodeops status 20261122-101500-ab12\n\n    nodeops status cluster.yaml   # its latest run"
)
def status(run_id: RunArg = None) -> None:
    """Show each host's job state: running, exited CODE, killed or unreachable, then the run's
    verdict with its timeline, or, while it runs, on how many hosts and since when.

    Exit 0 while every host is running or exited 0; 1 when any host failed, was killed or
    cannot be reached.
    """

    with errors():
        control.status(run_id, ConsoleSink())


class LogView:
    """`nodeops logs`' filters over the console: ``--host`` and ``--rank`` keep only those lines
    (``--rank`` keeps rank lines only), ``--tail N`` each host's last N lines, printed when the log
    has been read. Hosts asked for that gave no line are named on stderr."""

    def __init__(self, sink: ConsoleSink, hosts: list[str], ranks: list[int], tail: int | None) -> None:
        self.sink, self.hosts, self.ranks, self.tail = sink, hosts, set(ranks), tail
        self.seen: set[str] = set()
        self.kept: dict[str, deque[str]] = {}

    def note(self, text: str) -> None:
        self.sink.note(text)

    def out(self, text: str) -> None:
        self.sink.out(text)

    def report(self, report: Any) -> None:
        self.sink.report(report)

    def line(self, host: str, text: str) -> None:
        self.seen.add(host)
        if self.hosts and host not in self.hosts:
            return
        if self.ranks:
            m = RANK_LINE.match(text)
            if m is None or int(m.group(1)) not in self.ranks:
                return
        if self.tail is None:
            self.sink.line(host, text)
        else:
            self.kept.setdefault(host, deque(maxlen=self.tail)).append(text)

    def flush(self) -> None:
        for host, lines in self.kept.items():
            for text in lines:
                self.sink.line(host, text)
        self.kept.clear()
        missing = [h for h in self.hosts if h not in self.seen]
        if missing:
            seen = ", ".join(sorted(self.seen)) or "none"
            err(f"no log line from {', '.join(missing)} (hosts with lines in this run's logs: {seen})")


RANK_LINE = re.compile(r"\[rank(\d+)\]:")


@app.command(
    epilog="Examples:\n\n    nodeops logs 20261122-101500-ab12\n\n    nodeops logs -f"
    "\n\n    nodeops logs --tail 20 --host node2\n\n    nodeops logs --rank 3 --rank 5"
)
def logs(
    run_id: RunArg = None,
    follow: Annotated[bool, typer.Option("-f", "--follow", help="Keep streaming until the job ends.")] = False,
    tail: Annotated[
        int | None,
        typer.Option("--tail", min=0, help="Only each host's last N lines (of the log read whole; not with -f)."),
    ] = None,
    host: Annotated[list[str] | None, typer.Option("--host", help="Only this host's lines (repeatable).")] = None,
    rank: Annotated[
        list[int] | None, typer.Option("--rank", min=0, help="Only this global rank's lines (repeatable).")
    ] = None,
) -> None:
    """Print every host's log, each line prefixed with host and rank; `-f` streams until the end."""

    if follow and tail is not None:
        fail("--tail reads the log whole and cannot be used with -f (narrow a stream with --host/--rank)", EXIT_SPEC)
    view = LogView(ConsoleSink(), host or [], rank or [], tail)
    with errors():
        try:
            control.logs(run_id, follow, view)
        finally:
            view.flush()


@app.command(
    epilog="Examples:\n\n    nodeops stop 20261122-101500-ab12\n\n    nodeops stop cluster.yaml   # its latest run"
)
def stop(run_id: RunArg = None) -> None:
    """Stop every rank of a run on every host (SIGTERM to its process group, then SIGKILL).

    Without a run id or spec it stops the one live run launched from this machine; with more
    than one live it refuses (exit 2) and lists them with their specs.
    """

    with errors():
        control.stop(run_id, ConsoleSink())


@app.command(
    epilog="Examples:\n\n    nodeops stacks 20261122-101500-ab12\n\n    nodeops stacks --native"
    "\n\n    nodeops stacks --json | jq '.odd'"
)
def stacks(
    run_id: RunArg = None,
    native: Annotated[bool, typer.Option("--native", help="Add C/C++ frames (py-spy only).")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the groups and every rank's method as JSON.")] = False,
    method: Annotated[
        str,
        typer.Option(
            "--method",
            help="auto: py-spy where it is installed and ptrace is allowed, else the signal hook the launch "
            "put in every rank (faulthandler; no ptrace); or force py-spy or signal.",
        ),
    ] = "auto",
) -> None:
    """Where is every rank now? The Python stack of every rank of a live run, on every host at once.

    Ranks with the same stack are grouped; the ranks whose stack differs from the majority come
    first (in a hang, those are the stuck ones). Each rank's raw dump is saved in the run's record
    here, under `stacks/TIME/`. A run that is still starting (right after `launch --detach`) is
    waited for, up to a minute. Exit 2 when the run has no live rank (it has ended). On Slurm
    the stacks are taken in one `srun --overlap` step beside the job's training step.
    """

    with errors():
        doc = control.stacks(run_id, native, method, ConsoleSink())
    if as_json:
        print(json.dumps(doc, indent=2))
        return
    ranks, hosts = len(doc["methods"]), {m["host"] for m in doc["methods"].values()}
    err(f"==> {ranks} rank(s) on {len(hosts)} host(s); stacks taken in {doc['seconds']:.1f}s")
    for g in doc["groups"]:
        label = "DIFFERS " if g["odd"] else ""
        print(f"{label}{S.group_line(g)}")
    by_method: dict[str, list[int]] = {}
    for rank, m in doc["methods"].items():
        by_method.setdefault(m["method"], []).append(int(rank))
    err("    method: " + "; ".join(f"{m} for ranks {S.span(r)}" for m, r in sorted(by_method.items())))
    for rank, m in sorted(doc["methods"].items()):
        if m.get("fallback_from"):
            err(f"    rank {rank} ({m['host']}): {m['method']}, because {m['fallback_from']}")
    for host, why in doc["no_rank"].items():
        err(f"    {host}: no rank here ({why})")
    err(f"    raw dumps: {doc['dir']}")


def _when(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(ts)) if ts else "?"


@app.command(
    epilog="Examples:\n\n    nodeops runs\n\n    nodeops runs --spec cluster.yaml --state running"
    "\n\n    nodeops runs --json | jq '.[] | select(.state==\"failed\")'"
    "\n\n    nodeops runs --local   # no ssh: only what this machine recorded"
)
def runs(
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON list instead of a table.")] = False,
    local: Annotated[
        bool, typer.Option("--local", help="No ssh: runs without a verdict here show as unknown.")
    ] = False,
    spec: Annotated[
        str | None, typer.Option("--spec", metavar="FILE", help="Only the runs launched from this spec file.")
    ] = None,
    state: Annotated[
        list[str] | None,
        typer.Option("--state", help="Only runs in this state (repeatable): running, ok, failed, stopped, hung, ..."),
    ] = None,
) -> None:
    """List the runs launched from this machine, newest first: id, state, exit code, runner,
    hosts, start time, goodput (the share of its wall time in which training ran) and spec.

    A run's state comes from its supervisor's verdict (ok, failed, stopped), kept here once known;
    for the others one ssh to each run's chief says whether it still runs (ssh gets 3 s to
    connect: a record of a cluster that is gone costs no more). `gone`: the chief has no trace of
    it; `unreachable`: its chief could not be asked.
    """

    with errors():
        odd = [s for s in state or [] if s not in R.STATES]
        if odd:
            fail(f"error: --state {odd[0]!r}: use one of {', '.join(R.STATES)}", EXIT_SPEC)
        found = R.local_runs()
        if spec is not None:
            found = control.runs_of_spec(found, spec)
        if not local:
            R.refresh(found, connect_timeout=control.QUICK_CONNECT, shortcut=True)
        if state:
            found = [r for r in found if r.state in state]
        if as_json:
            typer.echo(json.dumps([r.row() for r in found], indent=2))
            return
        if not found:
            if spec is not None or state:
                err("no run matches " + " and ".join(
                    ([f"--spec {control.spec_key(spec)}"] if spec is not None else []) +
                    ([f"--state {'/'.join(state)}"] if state else [])))  # fmt: skip
            else:
                err("no runs launched from this machine yet (nodeops launch SPEC train.py starts one)")
            return
        typer.echo(f"{'RUN ID':20} {'STATE':11} {'EXIT':>4}  {'RUNNER':9} {'HOSTS':>5}  {'STARTED':16}  "
                   f"{'GOODPUT':>7}  SPEC")  # fmt: skip
        for r in found:
            j = r.job
            code = "" if r.exit_code is None else str(r.exit_code)
            good = "" if r.goodput is None else f"{r.goodput['goodput'] * 100:.0f}%"
            typer.echo(f"{j.run_id:20} {r.state:11} {code:>4}  {j.runner:9} {len(j.kill_hosts):>5}  "
                       f"{_when(j.started):16}  {good:>7}  {j.spec}")  # fmt: skip


@app.command(
    epilog="Examples:\n\n    nodeops clean --older-than 7d --dry-run\n\n    nodeops clean --keep 20"
    "\n\n    nodeops clean --all"
)
def clean(
    older_than: Annotated[
        str | None, typer.Option(metavar="AGE", help="Only runs started longer ago than AGE: 30m, 12h, 7d, 2w.")
    ] = None,
    keep: Annotated[
        int | None,
        typer.Option(metavar="N", min=0, help="Keep the newest N runs (running ones count), and N artifact dirs."),
    ] = None,
    all_: Annotated[bool, typer.Option("--all", help="Every finished run.")] = False,
    dry_run: Annotated[
        bool,
        typer.Option("--dry-run", help="Say what would be removed; remove nothing (it still asks chiefs for states)."),
    ] = False,
    forget_unreachable: Annotated[
        bool,
        typer.Option(
            "--forget-unreachable",
            help="Also drop the records here of chosen runs whose hosts do not answer (a cluster that "
            "is gone): runs with a verdict, and runs without one started over a day ago. Their dirs on "
            "those hosts are not touched.",
        ),
    ] = False,
) -> None:
    """Remove finished runs: their dirs on every host of the run, their records here, and the
    playbook artifacts of setup/check runs (~/.nodeops/runs).

    A run that is running, or whose chief cannot be reached, is never touched; on each host a
    run dir is removed only when no process of that run is alive there. A run whose dirs could
    not all be removed keeps its record here, so a later clean retries it.
    """

    with errors():
        if older_than is None and keep is None and not all_:
            fail("error: say what to remove: --older-than AGE, --keep N or --all (add --dry-run to preview)", 2)
        age = R.parse_duration(older_than) if older_than is not None else None
        found = R.local_runs()
        R.refresh(found)
        chosen = R.choose(found, older_than=age, keep=keep)
        forget = [r for r in R.choose(found, older_than=max(age or 0, 86400), keep=keep, states=("unreachable",))
                  if forget_unreachable]  # fmt: skip
        arts = R.choose_artifacts(R.artifact_dirs(runs_dir()), older_than=age, keep=keep)
        for r in found:  # what is kept whatever the criteria, and why
            if r in chosen or r in forget or r.state == "unreachable":
                continue
            if r.state not in R.FINISHED:
                err(f"keep   {r.job.run_id}  {r.state}: {r.detail or 'no verdict'}")
            elif not r.verdict and time.time() - r.job.started < R.INFERRED_MIN_AGE:
                err(f"keep   {r.job.run_id}  {r.state}: no verdict, and started under "
                    f"{R.INFERRED_MIN_AGE / 60:.0f} min ago (a launch may still be starting it)")  # fmt: skip
        unreachable = [r for r in found if r.state == "unreachable" and r not in forget]
        if unreachable:
            err(f"keep   {len(unreachable)} run(s) whose chief did not answer (e.g. {unreachable[0].detail}); "
                "--forget-unreachable drops their records here")  # fmt: skip
        verb = "would remove" if dry_run else "remove"
        for r in chosen:
            err(f"{verb} {r.job.run_id}  {r.state:8} {_when(r.job.started)}  {R.human_size(r.size)} here, "
                f"and its dir on {', '.join(r.job.kill_hosts)}")  # fmt: skip
        if forget:
            err(f"{'would forget' if dry_run else 'forget'} {len(forget)} unreachable run(s) (records here only)")
        art_size = sum(a.size for a in arts)
        if arts:
            err(f"{verb} {len(arts)} playbook artifact dir(s) in {runs_dir()} ({R.human_size(art_size)})")
        if dry_run:
            err(f"dry run: {len(chosen) + len(forget)} run(s) and {len(arts)} artifact dir(s) would be removed; "
                "nothing was")  # fmt: skip
            return
        done = R.remove(chosen, forget_unreachable)
        freed = done.freed + art_size + R.forget(forget)
        for a in arts:
            R.rmtree(a.path)
        for run_id, why in done.problems.items():
            err(f"kept   {run_id}: " + "; ".join(why))
        err(f"removed {len(done.removed_local) + len(forget)} run(s) and {len(arts)} artifact dir(s); "
            f"freed {R.human_size(freed)} here")  # fmt: skip
        if done.problems:
            raise typer.Exit(EXIT_FAILURE)
