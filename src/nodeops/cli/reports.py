"""The reports the CLI draws as tables (rich): a fabric measurement."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from nodeops.node.fabric import FabricReport
from nodeops.node.fabric_probe import human_bytes


def print_fabric(report: FabricReport, stderr: bool = False) -> None:
    console = Console(stderr=stderr)
    table = Table(title=f"fabric: all-reduce over all {report.world} rank(s) ({report.backend})", title_justify="left")
    for col in ("size", "time", "algbw Gbit/s", "busbw Gbit/s", "runs"):
        table.add_column(col, justify="right")
    for r in report.sweep:
        t = f"{r.seconds * 1e6:.0f} us" if r.seconds < 1e-3 else f"{r.seconds * 1e3:.2f} ms"
        table.add_row(human_bytes(r.bytes), t, f"{r.algbw:.3g}", f"{r.busbw:.3g}", str(r.iters))
    console.print(table)
    lat = report.latency
    if lat is not None:
        console.print(f"latency (all-reduce of {human_bytes(lat.bytes)}): {lat.seconds * 1e6:.0f} us")
    if report.pairs:
        table = Table(title="fabric: node pairs (slowest first)", title_justify="left")
        for col in ("pair", "ranks", "busbw Gbit/s", "verdict"):
            table.add_column(col)
        for p in report.pairs:
            color = "green" if p.verdict == "ok" else "red"
            what = f"{p.a} - {p.b}" + (" (again, vs a healthy node)" if p.confirm else "")
            table.add_row(escape(what), str(p.ranks), f"{p.busbw:.3g}", f"[{color}]{p.verdict}[/]")
        console.print(table)
    table = Table(title="fabric: nodes (slowest first)", title_justify="left")
    for col in ("node", "best pair Gbit/s", "network", "verdict"):
        table.add_column(col)
    for n in report.nodes:
        color = "green" if n.verdict == "ok" else "red"
        table.add_row(escape(n.name), "-" if n.best is None else f"{n.best:.3g}", escape(n.interface),
                      f"[{color}]{n.verdict}[/]")  # fmt: skip
    console.print(table)
    for note in report.notes:
        console.print(f"note: {escape(note)}")
    for problem in report.problems:
        console.print(f"[red]fabric: {escape(problem)}[/]")
    verdict = "[green]ok[/]" if report.ok else "[red]fail[/]"
    console.print(f"fabric: {verdict} (measured in {report.elapsed:.1f}s)")
