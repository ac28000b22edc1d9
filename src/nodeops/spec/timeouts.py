"""A run's timeouts as one set, in the order they must fire (pure; no I/O).

nodeops must name the culprit before PyTorch ends the job naming nobody, so the timeouts nest:

1. the stall report (``stall.py``): learned from the run's own pace, never before 5 s; it only
   reports (which rank, on which host, in which frame);
2. NCCL's InfiniBand retries (``NCCL_IB_TIMEOUT``/``NCCL_IB_RETRY_CNT`` from ``network.nccl`` or
   ``env``): a link that stays down fails the collective with NCCL's own error;
3. the hard hang timeout (``launch.hang_timeout``): every rank's stack, the stuck rank named, the
   run stopped (exit 124). Default: half the collective timeout, so it fires with time to spare
   before PyTorch's; a healthy phase longer than that touches ``$NODEOPS_PROGRESS_FILE``;
4. PyTorch's NCCL heartbeat monitor (``TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC``, 8 min by default):
   kills a rank whose NCCL watchdog thread is stuck;
5. the collective timeout (``init_process_group(timeout=...)``; ``launch.collective_timeout``
   says what the script passes): 10 min for NCCL, 30 min for gloo by default. A rank waiting
   longer in a collective is ended by PyTorch with no rank named.

Start-up is apart: the hang timeout counts from every node's first progress, and before that
at least ``HANG_STARTUP_GRACE`` (5 min), under torchrun's rendezvous join timeout (10 min).
"""

from __future__ import annotations

from dataclasses import dataclass

from nodeops.node import stacks as S
from nodeops.node import stall as ST
from nodeops.spec.model import ResourceSpec

NCCL_COLLECTIVE = 600.0  # PyTorch's default_pg_nccl_timeout
GLOO_COLLECTIVE = 1800.0  # PyTorch's default_pg_timeout (gloo and the others)
NCCL_HEARTBEAT = 480.0  # TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC's default
RDZV_JOIN = 600.0  # torchrun's rendezvous join_timeout default
IB_TIMEOUT = 20  # NCCL_IB_TIMEOUT's default (NCCL >= 2.14): 4.096 us * 2^20 per try
IB_RETRY_CNT = 7  # NCCL_IB_RETRY_CNT's default


@dataclass(frozen=True)
class Row:
    name: str
    seconds: float | None  # None: learned, or off
    source: str  # where the value comes from
    effect: str  # what happens when it fires


def uses_nccl(spec: ResourceSpec) -> bool:
    """NCCL runs where a node lists GPUs (the flight recorder's rule too)."""
    return any(n.gpus == "auto" or bool(n.gpus) for n in spec.nodes)


def env_value(spec: ResourceSpec, name: str) -> str | None:
    """A variable as the ranks get it: network.nccl, then env (which wins)."""
    value = spec.network.nccl.get(name)
    var = spec.env.get(name)
    if var is not None and var.value is not None:
        value = var.value
    return value


def collective(spec: ResourceSpec) -> tuple[float, str]:
    if spec.launch.collective_timeout:
        return spec.launch.collective_timeout, "launch.collective_timeout"
    if uses_nccl(spec):
        return NCCL_COLLECTIVE, "PyTorch's default for NCCL"
    return GLOO_COLLECTIVE, "PyTorch's default for gloo"


def hard(spec: ResourceSpec) -> tuple[float | None, str]:
    """The hard hang timeout in seconds (None: off) and where it comes from."""
    value = spec.launch.hang_timeout
    if value is not None:
        return (value or None), "launch.hang_timeout" + (" (0: off)" if not value else "")
    return collective(spec)[0] / 2, "default: half the collective timeout"


def ib_retry(spec: ResourceSpec) -> tuple[float, str] | None:
    """How long NCCL retries a dead InfiniBand link before failing, when its settings are numbers."""
    t, n = env_value(spec, "NCCL_IB_TIMEOUT"), env_value(spec, "NCCL_IB_RETRY_CNT")
    try:
        exp, count = int(t) if t is not None else IB_TIMEOUT, int(n) if n is not None else IB_RETRY_CNT
    except ValueError:
        return None
    src = "network.nccl" if t is not None or n is not None else "NCCL's default"
    return 4.096e-6 * 2 ** min(exp, 40) * (count + 1), src


def heartbeat(spec: ResourceSpec) -> tuple[float, str] | None:
    raw = env_value(spec, "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC")
    if raw is None:
        return NCCL_HEARTBEAT, "PyTorch's default"
    try:
        return float(raw), "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"
    except ValueError:
        return None


def rows(spec: ResourceSpec) -> list[Row]:
    """The run's timeouts, in the order they fire."""
    slurm_off = spec.on_slurm and hard(spec)[0] is None  # Slurm's stall watch runs in the hang watchdog
    out = [Row("stall report", None, f"learned from the run's pace (at least {ST.FLOOR:g}s)",
               "off: on Slurm it runs in the hang watchdog, which launch.hang_timeout: 0 turns off" if slurm_off
               else "reports the rank that differs, its host and frame; stops nothing")]  # fmt: skip
    nccl = uses_nccl(spec)
    ib = ib_retry(spec) if nccl else None
    if ib is not None:
        out.append(Row("NCCL InfiniBand retries", ib[0], ib[1], "NCCL fails the collective (its own error)"))
    secs, src = hard(spec)
    out.append(Row("hang timeout", secs, src, "every rank's stack, the stuck rank named, the run stopped (exit 124)"
                   if secs else "off: nothing stops a hung run before PyTorch"))  # fmt: skip
    hb = heartbeat(spec) if nccl else None
    if hb is not None:
        out.append(Row("NCCL heartbeat monitor", hb[0], hb[1], "PyTorch kills a rank whose NCCL watchdog is stuck"))
    coll, csrc = collective(spec)
    out.append(Row("collective timeout", coll, csrc, "PyTorch ends the job; no rank is named"))
    return sorted(out, key=lambda r: -1.0 if r.name == "stall report" else r.seconds or float("inf"))


def start_up_rows(spec: ResourceSpec) -> list[Row]:
    secs = hard(spec)[0]
    grace = max(secs or 0.0, S.HANG_STARTUP_GRACE) if secs else None
    return [Row("start-up (before every node's first progress)", grace, "at least 5 min",
                "as the hang timeout" if grace else "off"),
            Row("torchrun rendezvous join", RDZV_JOIN, "torchrun's default",
                "torchrun fails the start-up")]  # fmt: skip


def human(secs: float | None) -> str:
    if secs is None:
        return "-"
    if secs >= 120 and secs % 60 == 0:
        return f"{secs / 60:g}m"
    return f"{secs:.3g}s" if secs < 10 else f"{secs:.0f}s"


def table(spec: ResourceSpec) -> list[str]:
    """``launch --dry-run``'s timeout table: training's timeouts in firing order, then start-up's."""
    lines = ["timeouts, in the order they fire (nodeops names the culprit before PyTorch ends the job):"]
    hang = hard(spec)[0]
    fire = [r for r in rows(spec) if r.name == "stall report" or r.seconds is not None]
    for i, r in enumerate(fire, 1):
        late = r.name == "NCCL InfiniBand retries"  # NCCL's own error must come before the hang timeout
        odd = (hang is not None and r.seconds is not None and (r.seconds >= hang if late else r.seconds <= hang)
               and r.name in ("NCCL InfiniBand retries", "NCCL heartbeat monitor", "collective timeout"))  # fmt: skip
        lines.append(f"  {i}. {r.name:26} {human(r.seconds):>6}  ({r.source}): {r.effect}"
                     + ("  <- out of order (see the spec's warning)" if odd else ""))  # fmt: skip
    for r in rows(spec):
        if r not in fire:
            lines.append(f"     {r.name} ({r.source}): {r.effect}")
    for r in start_up_rows(spec):
        lines.append(f"     {r.name}: {human(r.seconds)} ({r.source}): {r.effect}")
    return lines


@dataclass(frozen=True)
class Problem:
    path: tuple[str | int, ...]
    message: str
    fix: str
    error: bool  # else a warning


def problems(spec: ResourceSpec) -> list[Problem]:
    """Where the spec's values break the order: the hang timeout must fire before PyTorch's
    collective timeout (an error); NCCL's own timeouts that would fire first are warned of."""
    out: list[Problem] = []
    secs, _ = hard(spec)
    coll, csrc = collective(spec)
    explicit = bool(spec.launch.hang_timeout)
    if explicit and secs is not None and secs >= coll:
        out.append(Problem(("launch", "hang_timeout"),
                           f"the hang timeout {human(secs)} is not below the collective timeout {human(coll)} "
                           f"({csrc}): PyTorch would end a hung job first, naming no rank",
                           f"set launch.hang_timeout below {human(coll)} (e.g. {human(coll / 2)}), or set "
                           "launch.collective_timeout to what your script passes to "
                           "init_process_group(timeout=...)", True))  # fmt: skip
    if secs is None or not uses_nccl(spec):
        return out
    ib = ib_retry(spec)
    if ib is not None and ib[1] != "NCCL's default" and ib[0] >= secs and "NCCL_IB_TIMEOUT" in spec.network.nccl:
        out.append(Problem(("network", "nccl", "NCCL_IB_TIMEOUT"),
                           f"NCCL retries a dead InfiniBand link for {human(ib[0])}, not less than the hang timeout "
                           f"{human(secs)}: a lost link is reported as a hang, not as NCCL's error",
                           "lower NCCL_IB_TIMEOUT (20 is NCCL's default: about 34 s with 7 retries)",
                           False))  # fmt: skip
    hb = heartbeat(spec)
    if hb is not None and hb[1] != "PyTorch's default" and hb[0] <= secs:
        where = ("env", "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC") if "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC" in spec.env else (
            "network", "nccl", "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC")  # fmt: skip
        out.append(Problem(where, f"PyTorch's NCCL heartbeat monitor kills a stuck rank after {human(hb[0])}, before "
                           f"the hang timeout {human(secs)}: the rank dies unnamed",
                           f"raise it above {human(secs)} or lower launch.hang_timeout", False))  # fmt: skip
    return out
