"""The Slurm backend: one batch script submitted through the login node (``nodeops.slurm``
builds it and speaks sbatch/squeue/scontrol/scancel); status, logs and stop by the job's id."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import ClassVar

from nodeops import check, jobs, slurm
from nodeops.backends.base import Backend, Capabilities, DryRun, LaunchRequest, RunState, Sink
from nodeops.errors import EXIT_FAILURE, ExitWith
from nodeops.interrupts import deferred_interrupts, ignoring_interrupts, sigterm_as_interrupt
from nodeops.quoting import sh_word
from nodeops.render import ssh_config
from nodeops.spec import LoadedSpec

NO_LOG_WARN = 20.0  # seconds RUNNING without a batch log before `follow` says the run dir may not be shared

# A Slurm job's state, as `nodeops runs` names states
_RUN_STATES = {"COMPLETED": "ok", "CANCELLED": "stopped", **{s: "running" for s in slurm.LIVE}}


def login_of(loaded: LoadedSpec, cfg: Path) -> slurm.Login:
    node = loaded.spec.login_node()
    return slurm.Login(loaded.spec.alias(node) if node is not None else None, cfg)


def login_for(job: jobs.Job) -> slurm.Login:
    return slurm.Login(job.slurm_login or None, job.ssh_config)


def remember(job: jobs.Job, st: slurm.Poll) -> None:
    """Keep the last state Slurm gave (it forgets a job MinJobAge after its end)."""
    if st.state and st.state != job.slurm_state:
        dataclasses.replace(job, slurm_state=st.state).save()


def cancel(job: jobs.Job) -> tuple[slurm.Poll, str]:
    """scancel; wait KillWait for the job to end; then SIGKILL whatever is left (--full)."""
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


def follow(job: jobs.Job, sink: Sink, *, cancel_on_interrupt: bool) -> slurm.Poll:
    """Stream the job's logs until it ends. Ctrl-C: cancel it (attached launch) or only stop
    following (`logs -f`), as the caller says."""
    login = login_for(job)
    fol = slurm.Follower(login, job.run_id, job.slurm_job, sink.line)
    last_state = ""
    running_since: float | None = None
    warned = False

    def on_poll(st: slurm.Poll) -> None:
        nonlocal last_state, running_since, warned
        if st.state and st.state != last_state:
            last_state = st.state
            sink.note(f"==> job {job.slurm_job}: {slurm.describe(st)}")
            remember(job, st)
        if st.state == "RUNNING" and slurm.BATCH_LOG not in st.files and not warned:
            running_since = running_since or time.monotonic()
            if time.monotonic() - running_since > NO_LOG_WARN:
                warned = True
                sink.note(
                    f"warning: job {job.slurm_job} has run {NO_LOG_WARN:.0f}s and its batch log is not in "
                    f"~/.nodeops/runs/{job.run_id} on {login.where}: is that dir on a filesystem the nodes share?"
                )

    try:
        st = fol.until_end(on_poll=on_poll)
        last = last_state or job.slurm_state
        if st.forgotten and st.result is None and last in slurm.TERMINAL:
            st.state = last  # Slurm forgot it before we looked again: the last state seen
        return st
    except slurm.SlurmError as e:
        raise ExitWith(EXIT_FAILURE, f"==> lost track of job {job.slurm_job}: {e}; see `nodeops status "
                       f"{job.run_id}`, `nodeops stop {job.run_id}` cancels it") from None  # fmt: skip
    except KeyboardInterrupt:
        if not cancel_on_interrupt:
            sink.note(f"==> stopped following; job {job.slurm_job} goes on (nodeops stop {job.run_id} cancels it)")
            raise ExitWith(130) from None
        with ignoring_interrupts():
            _st, how = cancel(job)
        raise ExitWith(130, f"==> run {job.run_id} interrupted: job {job.slurm_job} cancelled; {how}") from None


def logs_tail(job: jobs.Job) -> dict[str, list[str]]:
    """Each host's last lines (the batch log's as ``batch``), read at the end of the job."""
    st = slurm.poll(login_for(job), job.run_id, job.slurm_job, {}, max_bytes=256 << 10, whole=True, tail=True)
    return {slurm.host_of(name): slurm.last_run(text.splitlines())[-slurm.TAIL_LINES :]
            for name, (_, _, text) in st.files.items()}  # fmt: skip


def verdict(job: jobs.Job, st: slurm.Poll, sink: Sink) -> None:
    """Report a finished job like an ssh run: the node whose failure started it and its last lines."""
    if slurm.exit_code(st) == 0:
        sink.note(f"==> run {job.run_id} finished: job {job.slurm_job} {slurm.describe(st)}")
        return
    if st.state == "CANCELLED":
        raise ExitWith(130, f"==> run {job.run_id}: job {job.slurm_job} was cancelled")
    tails = logs_tail(job)
    batch = tails.pop("batch", [])
    code = slurm.exit_code(st, batch, tails)
    sig = (st.result or {}).get("signal")
    if sig:
        raise ExitWith(code, f"==> run {job.run_id}: job {job.slurm_job} got {sig} before its time limit; it was "
                       f"forwarded to every rank, and torchrun then ended them: {slurm.describe(st)}")  # fmt: skip
    first = slurm.first_failure(batch, tails)
    if first is None:
        if not batch:
            sink.note(f"    no batch log in ~/.nodeops/runs/{job.run_id} on the login node: the job could not "
                      "write there (is that dir on a filesystem every node shares?)")  # fmt: skip
        for line in batch[-10:]:
            sink.note(f"    batch | {line}")
        raise ExitWith(code, f"==> run {job.run_id} {slurm.describe(st)}: no task's failure was reported")
    host, rc = first
    own, summary = jobs.failure_lines(tails.get(host, []))
    sink.note(f"==> run {job.run_id} FAILED: job {job.slurm_job} {st.state}; first failure on {host} "
              f"(exit code {rc}); its last lines:")  # fmt: skip
    for line in own or summary:
        sink.note(f"    {host} {line}")
    raise ExitWith(code, f"==> srun stopped every other node's ranks (--kill-on-bad-exit); "
                   f"`nodeops logs {job.run_id}` has it all")  # fmt: skip


class SlurmBackend(Backend):
    name: ClassVar[str] = "slurm"
    capabilities: ClassVar[Capabilities] = Capabilities(
        runners=frozenset({"torchrun"}), detach=True, via_ansible=False,
        script=False, fabric=False, sync=True, preflight=False,
    )  # fmt: skip
    # On Slurm, setup prepares the shared filesystem through the login node: the Python env, the
    # workdir and the env file. The ssh mesh and DeepSpeed's hostfile are for ssh launches.
    setup_skips: ClassVar[tuple[str, ...]] = ("ssh_mesh", "deepspeed_env")

    def summary(self, loaded: LoadedSpec) -> str:
        s = loaded.spec
        if s.slurm is None:
            raise ValueError("a Slurm spec without its slurm section")
        login = s.login_node()
        gpus = (f"{s.slurm.gpus_per_node} GPU(s) per node" if s.slurm.gpus_per_node is not None
                else f"{s.slurm.gpus} GPU(s) in all" if s.slurm.gpus else "no GPUs asked for")  # fmt: skip
        return f"Slurm, {s.slurm.nodes} node(s), {gpus}, sbatch " + (
            f"on the login node {login.address}" if login is not None else "on this machine"
        )

    def files(self, loaded: LoadedSpec) -> dict[str, str]:
        return {slurm.SCRIPT: slurm.batch_script(loaded)}  # what `launch` submits: `sbatch job.sbatch train.py`

    def check(self, loaded: LoadedSpec, timeout: float, sink: Sink) -> check.Report:
        s = loaded.spec.slurm
        sink.note(f"==> checking the {s.nodes if s else 0} node(s) Slurm gives, in one srun step")
        nodes_spec, result = check.run_slurm(loaded, timeout=timeout)
        return check.as_srun_rows(check.evaluate(nodes_spec, result), result.get("missing", ""))

    def dry_run(self, loaded: LoadedSpec, request: LaunchRequest) -> DryRun:
        out = DryRun()
        node = loaded.spec.login_node()
        where = f"on the login node {loaded.spec.alias(node)}" if node is not None else "on this machine"
        out.out(f"# {slurm.SCRIPT}, submitted {where} as:")
        out.out(f"#   sbatch --parsable --output=RUN_DIR/{slurm.BATCH_LOG} RUN_DIR/{slurm.SCRIPT} "
                + " ".join(sh_word(a) for a in request.argv))  # fmt: skip
        out.out(slurm.batch_script(loaded).removesuffix("\n"))
        return out

    def launch(self, loaded: LoadedSpec, request: LaunchRequest, sink: Sink) -> None:
        """Submit the batch script; then follow it like `logs -f` (Ctrl-C cancels the job) and exit
        with its code, or (``--detach``) print the run id and return."""
        user_argv = request.argv
        run_id = jobs.new_run_id()
        local = jobs.jobs_dir() / run_id
        local.mkdir(mode=0o700)
        (local / "ssh_config").write_text(ssh_config(loaded))
        login = login_of(loaded, local / "ssh_config")
        script = slurm.batch_script(loaded)
        (local / slurm.SCRIPT).write_text(script)
        t0 = time.monotonic()
        nodes = loaded.spec.slurm.nodes if loaded.spec.slurm else 0
        sink.note(f"==> run {run_id}: sbatch on {login.where} ({nodes} node(s))")
        # Ctrl-C or SIGTERM while sbatch runs waits until the job's record is saved, then cancels it:
        # a job is never queued without a record to stop it by.
        noted = "==> interrupt noted: waiting for sbatch to answer, then the job is cancelled"
        with deferred_interrupts(lambda: sink.note(noted)) as interrupted:
            try:
                job_id = slurm.submit(login, run_id, script, user_argv)
            except slurm.SlurmError as e:
                job_id = ""
                why = str(e)
            if job_id:
                job = jobs.Job(run_id=run_id, dir=local, hosts=[login.host or "localhost"], argv=user_argv,
                               runner="torchrun", chief=login.host or "localhost",
                               spec=str(request.spec_path.resolve()), started=time.time(), backend="slurm",
                               slurm_job=job_id, slurm_login=login.host or "")  # fmt: skip
                job.save()
        if not job_id:
            raise ExitWith(130 if interrupted else EXIT_FAILURE,
                           f"launch failed: {why}" + ("; interrupted" if interrupted else ""))  # fmt: skip
        sink.note(f"==> submitted Slurm job {job_id} in {time.monotonic() - t0:.1f}s")
        if interrupted:
            with ignoring_interrupts():
                _st, how = cancel(job)
            raise ExitWith(130, f"==> run {run_id} interrupted while submitting: job {job_id} cancelled; {how}")
        if request.detach:
            sink.note(f"    nodeops status {run_id}  |  nodeops logs {run_id} -f  |  nodeops stop {run_id}")
            sink.out(run_id)
            return
        sink.note("==> following its logs (Ctrl-C cancels the job)")
        with sigterm_as_interrupt():
            st = follow(job, sink, cancel_on_interrupt=True)
        (local / "result.json").write_text(json.dumps({"slurm": {"state": st.state, "exit": st.exit,
                                                                 "result": st.result}}))  # fmt: skip
        verdict(job, st, sink)

    def status(self, job: jobs.Job, sink: Sink) -> None:
        st = slurm.poll(login_for(job), job.run_id, job.slurm_job, {}, max_bytes=0)
        remember(job, st)
        if st.forgotten and job.slurm_state in slurm.TERMINAL and st.result is None:
            st.state = job.slurm_state  # Slurm has forgotten it: the last (final) state seen here
        sink.out(f"job {job.slurm_job:10} {slurm.describe(st)}")
        if st.error or (st.state and st.state not in slurm.LIVE and st.state != "COMPLETED"):
            raise ExitWith(EXIT_FAILURE)
        if not st.state and slurm.exit_code(st) != 0:
            raise ExitWith(EXIT_FAILURE)

    def logs(self, job: jobs.Job, follow_: bool, sink: Sink) -> None:
        if follow_:
            st = follow(job, sink, cancel_on_interrupt=False)
            verdict(job, st, sink)
            return
        slurm.Follower(login_for(job), job.run_id, job.slurm_job, sink.line).step(whole=True)

    def stop(self, job: jobs.Job, sink: Sink) -> None:
        t = time.monotonic()
        st, how = cancel(job)
        sink.out(f"job {job.slurm_job:10} {slurm.describe(st)}")
        if st.error or (st.state and st.state not in slurm.TERMINAL):
            raise ExitWith(EXIT_FAILURE, f"run {job.run_id}: job {job.slurm_job} not confirmed stopped ({how})")
        sink.note(f"run {job.run_id}: job {job.slurm_job} {how} in {time.monotonic() - t:.1f}s")

    def run_state(self, job: jobs.Job) -> RunState:
        """A Slurm run's state from squeue/scontrol on its login node (or the last one seen there)."""
        try:
            st = slurm.poll(login_for(job), job.run_id, job.slurm_job, {}, max_bytes=0)
        except slurm.SlurmError as e:
            return RunState("unreachable", str(e))
        if st.error:
            return RunState("unreachable", f"Slurm job {job.slurm_job}: {st.error}")
        if st.forgotten and st.result is not None and not st.result.get("requeued"):
            # Slurm forgot it (MinJobAge); the batch script's own result says how it ended
            code = st.result.get("exit")
            return RunState("ok" if code == 0 else "failed", f"Slurm job {job.slurm_job}: {slurm.describe(st)}",
                            slurm.exit_code(st), True)  # fmt: skip
        state = st.state or (job.slurm_state if job.slurm_state in slurm.TERMINAL else "")
        if not state:  # forgotten, with neither a final state seen nor a result: it ended, how is lost
            return RunState("gone", f"Slurm job {job.slurm_job}: ended; Slurm has forgotten how (no result.json)")
        out = RunState(_RUN_STATES.get(state, "failed"),
                       f"Slurm job {job.slurm_job}: {slurm.describe(st) if st.state else state}")  # fmt: skip
        if out.state in ("ok", "failed", "stopped"):
            out.exit_code = slurm.exit_code(dataclasses.replace(st, state=state))
            out.verdict = True
        return out
