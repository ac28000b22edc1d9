"""`launch`, `status`, `logs` and `stop` for a spec with ``backend: slurm``: the same commands,
through sbatch/squeue/scancel on the login node (see nodeops.slurm)."""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from nodeops.cli.app import err, fail
from nodeops.errors import EXIT_FAILURE, EXIT_SPEC
from nodeops.spec import LoadedSpec

if TYPE_CHECKING:
    from nodeops.jobs import Job
    from nodeops.slurm import Login, Poll


def refuse_options(**given: bool) -> None:
    """Options of an ssh launch that have no meaning (yet) on Slurm: refused before anything runs."""
    bad = [name for name, on in given.items() if on]
    if bad:
        fail(f"error: {', '.join(bad)} cannot be used with backend: slurm (nothing was run)", EXIT_SPEC)


def dry_run(loaded: LoadedSpec, user_argv: list[str]) -> None:
    from nodeops import slurm
    from nodeops.quoting import sh_word

    node = loaded.spec.login_node()
    where = f"on the login node {loaded.spec.alias(node)}" if node is not None else "on this machine"
    typer.echo(f"# {slurm.SCRIPT}, submitted {where} as:")
    typer.echo(f"#   sbatch --parsable --output=RUN_DIR/{slurm.BATCH_LOG} RUN_DIR/{slurm.SCRIPT} "
               + " ".join(sh_word(a) for a in user_argv))  # fmt: skip
    typer.echo(slurm.batch_script(loaded), nl=False)


def launch(loaded: LoadedSpec, spec_path: Path, user_argv: list[str], *, attach: bool) -> None:
    """Submit the batch script; detached, print the run id; attached, follow it like `logs -f`
    (Ctrl-C cancels the job) and exit with its code."""
    import json

    from nodeops import jobs, slurm
    from nodeops.render import ssh_config

    run_id = jobs.new_run_id()
    local = jobs.jobs_dir() / run_id
    local.mkdir(mode=0o700)
    (local / "ssh_config").write_text(ssh_config(loaded))
    login = _login(loaded, local / "ssh_config")
    script = slurm.batch_script(loaded)
    (local / slurm.SCRIPT).write_text(script)
    t0 = time.monotonic()
    err(f"==> run {run_id}: sbatch on {login.where} ({loaded.spec.slurm.nodes if loaded.spec.slurm else 0} node(s))")
    # Ctrl-C or SIGTERM while sbatch runs waits until the job's record is saved, then cancels it:
    # a job is never queued without a record to stop it by.
    with deferred_interrupts() as interrupted:
        try:
            job_id = slurm.submit(login, run_id, script, user_argv)
        except slurm.SlurmError as e:
            job_id = ""
            why = str(e)
        if job_id:
            job = jobs.Job(run_id=run_id, dir=local, hosts=[login.host or "localhost"], argv=user_argv,
                           runner="torchrun", chief=login.host or "localhost", spec=str(spec_path.resolve()),
                           started=time.time(), backend="slurm", slurm_job=job_id,
                           slurm_login=login.host or "")  # fmt: skip
            job.save()
    if not job_id:
        fail(f"launch failed: {why}" + ("; interrupted" if interrupted else ""), 130 if interrupted else EXIT_FAILURE)
    err(f"==> submitted Slurm job {job_id} in {time.monotonic() - t0:.1f}s")
    if interrupted:
        with jobs.ignoring_interrupts():
            _st, how = cancel(job)
        fail(f"==> run {run_id} interrupted while submitting: job {job_id} cancelled; {how}", 130)
    if not attach:
        err(f"    nodeops status {run_id}  |  nodeops logs {run_id} -f  |  nodeops stop {run_id}")
        typer.echo(run_id)
        return
    err("==> following its logs (Ctrl-C cancels the job)")
    from nodeops.cli.launch_cmds import sigterm_as_interrupt

    with sigterm_as_interrupt():
        st = follow(job, cancel_on_interrupt=True)
    (local / "result.json").write_text(json.dumps({"slurm": {"state": st.state, "exit": st.exit,
                                                             "result": st.result}}))  # fmt: skip
    verdict(job, st)


NO_LOG_WARN = 20.0  # seconds RUNNING without a batch log before `follow` says the run dir may not be shared


@contextlib.contextmanager
def deferred_interrupts() -> Iterator[list[int]]:
    """SIGINT and SIGTERM inside are recorded, not raised: the list says which came."""
    got: list[int] = []

    def note(n: int, _frame: object) -> None:
        if not got:
            err("==> interrupt noted: waiting for sbatch to answer, then the job is cancelled")
        got.append(n)

    saved = {sig: signal.signal(sig, note) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield got
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def _login(loaded: LoadedSpec, cfg: Path) -> Login:
    from nodeops import slurm

    node = loaded.spec.login_node()
    return slurm.Login(loaded.spec.alias(node) if node is not None else None, cfg)


def login_for(job: Job) -> Login:
    from nodeops import slurm

    return slurm.Login(job.slurm_login or None, job.ssh_config)


def follow(job: Job, *, cancel_on_interrupt: bool) -> Poll:
    """Stream the job's logs until it ends. Ctrl-C: cancel it (attached launch) or only stop
    following (`logs -f`), as the caller says."""
    from nodeops import jobs, slurm
    from nodeops.cli.jobs_cmds import emit_line

    login = login_for(job)
    fol = slurm.Follower(login, job.run_id, job.slurm_job, emit_line)
    seen: dict[str, object] = {"state": "", "running_since": None, "warned": False}

    def on_poll(st: slurm.Poll) -> None:
        if st.state and st.state != seen["state"]:
            seen["state"] = st.state
            err(f"==> job {job.slurm_job}: {slurm.describe(st)}")
            remember(job, st)
        if st.state == "RUNNING" and slurm.BATCH_LOG not in st.files and not seen["warned"]:
            since = seen["running_since"] = seen["running_since"] or time.monotonic()
            assert isinstance(since, float)
            if time.monotonic() - since > NO_LOG_WARN:
                seen["warned"] = True
                err(
                    f"warning: job {job.slurm_job} has run {NO_LOG_WARN:.0f}s and its batch log is not in "
                    f"~/.nodeops/runs/{job.run_id} on {login.where}: is that dir on a filesystem the nodes share?"
                )

    try:
        st = fol.until_end(on_poll=on_poll)
        last = str(seen["state"] or job.slurm_state)
        if st.forgotten and st.result is None and last in slurm.TERMINAL:
            st.state = last  # Slurm forgot it before we looked again: the last state seen
        return st
    except slurm.SlurmError as e:
        fail(f"==> lost track of job {job.slurm_job}: {e}; see `nodeops status {job.run_id}`, "
             f"`nodeops stop {job.run_id}` cancels it", EXIT_FAILURE)  # fmt: skip
    except KeyboardInterrupt:
        if not cancel_on_interrupt:
            err(f"==> stopped following; job {job.slurm_job} goes on (nodeops stop {job.run_id} cancels it)")
            raise typer.Exit(130) from None
        with jobs.ignoring_interrupts():
            _st, how = cancel(job)
        fail(f"==> run {job.run_id} interrupted: job {job.slurm_job} cancelled; {how}", 130)


def remember(job: Job, st: Poll) -> None:
    """Keep the last state Slurm gave (it forgets a job MinJobAge after its end)."""

    import dataclasses

    if st.state and st.state != job.slurm_state:
        dataclasses.replace(job, slurm_state=st.state).save()


def verdict(job: Job, st: Poll) -> None:
    """Report a finished job like an ssh run: the node whose failure started it and its last lines."""
    from nodeops import jobs, slurm

    if slurm.exit_code(st) == 0:
        err(f"==> run {job.run_id} finished: job {job.slurm_job} {slurm.describe(st)}")
        return
    if st.state == "CANCELLED":
        fail(f"==> run {job.run_id}: job {job.slurm_job} was cancelled", 130)
    tails = logs_tail(job)
    batch = tails.pop("batch", [])
    code = slurm.exit_code(st, batch, tails)
    sig = (st.result or {}).get("signal")
    if sig:
        fail(f"==> run {job.run_id}: job {job.slurm_job} got {sig} before its time limit; it was forwarded to every "
             f"rank, and torchrun then ended them: {slurm.describe(st)}", code)  # fmt: skip
    first = slurm.first_failure(batch, tails)
    if first is None:
        if not batch:
            err(f"    no batch log in ~/.nodeops/runs/{job.run_id} on the login node: the job could not write "
                "there (is that dir on a filesystem every node shares?)")  # fmt: skip
        for line in batch[-10:]:
            err(f"    batch | {line}")
        fail(f"==> run {job.run_id} {slurm.describe(st)}: no task's failure was reported", code)
    host, rc = first
    own, summary = jobs.failure_lines(tails.get(host, []))
    err(f"==> run {job.run_id} FAILED: job {job.slurm_job} {st.state}; first failure on {host} "
        f"(exit code {rc}); its last lines:")  # fmt: skip
    for line in own or summary:
        err(f"    {host} {line}")
    fail(f"==> srun stopped every other node's ranks (--kill-on-bad-exit); `nodeops logs {job.run_id}` has it all",
         code)  # fmt: skip


def logs_tail(job: Job) -> dict[str, list[str]]:
    """Each host's last lines (the batch log's as ``batch``), read at the end of the job."""
    from nodeops import slurm

    st = slurm.poll(login_for(job), job.run_id, job.slurm_job, {}, max_bytes=256 << 10, whole=True, tail=True)
    return {slurm.host_of(name): slurm.last_run(text.splitlines())[-slurm.TAIL_LINES :]
            for name, (_, _, text) in st.files.items()}  # fmt: skip


def cancel(job: Job) -> tuple[Poll, str]:
    """scancel; wait KillWait for the job to end; then SIGKILL whatever is left (--full)."""
    from nodeops import slurm

    login = login_for(job)
    why = slurm.cancel(login, job.slurm_job)
    if why:
        return slurm.poll(login, job.run_id, job.slurm_job, {}, max_bytes=0), f"scancel failed: {why}"
    st = slurm.wait_gone(login, job.run_id, job.slurm_job, timeout=slurm.KILL_WAIT_MAX)
    how = "ended after scancel"
    if st.error and not st.state:
        return st, f"not confirmed: {slurm.describe(st)}"
    if st.state not in slurm.TERMINAL and st.state:
        slurm.cancel(login, job.slurm_job, kill=True)
        st = slurm.wait_gone(login, job.run_id, job.slurm_job, timeout=30)
        how = "killed (scancel --signal=KILL --full)"
    remember(job, st)
    return st, f"{how}: {slurm.describe(st)}"


def status(job: Job) -> None:
    from nodeops import slurm

    st = slurm.poll(login_for(job), job.run_id, job.slurm_job, {}, max_bytes=0)
    remember(job, st)
    if st.forgotten and job.slurm_state in slurm.TERMINAL and st.result is None:
        st.state = job.slurm_state  # Slurm has forgotten it: the last (final) state seen here
    typer.echo(f"job {job.slurm_job:10} {slurm.describe(st)}")
    if st.error or (st.state and st.state not in slurm.LIVE and st.state != "COMPLETED"):
        raise typer.Exit(EXIT_FAILURE)
    if not st.state and slurm.exit_code(st) != 0:
        raise typer.Exit(EXIT_FAILURE)


def logs(job: Job, follow_: bool) -> None:
    from nodeops import slurm
    from nodeops.cli.jobs_cmds import emit_line

    if follow_:
        st = follow(job, cancel_on_interrupt=False)
        verdict(job, st)
        return
    login = login_for(job)
    slurm.Follower(login, job.run_id, job.slurm_job, emit_line).step(whole=True)


def stop(job: Job) -> None:
    from nodeops import slurm

    t = time.monotonic()
    st, how = cancel(job)
    typer.echo(f"job {job.slurm_job:10} {slurm.describe(st)}")
    if st.error or (st.state and st.state not in slurm.TERMINAL):
        err(f"run {job.run_id}: job {job.slurm_job} not confirmed stopped ({how})")
        raise typer.Exit(EXIT_FAILURE)
    err(f"run {job.run_id}: job {job.slurm_job} {how} in {time.monotonic() - t:.1f}s")
