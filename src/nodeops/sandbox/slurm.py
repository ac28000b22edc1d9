"""The sandbox as a real Slurm cluster (``nodeops sandbox up --slurm``).

Debian's own Slurm packages (``slurmctld``, ``slurmd``, ``slurm-client``, ``munge``: 22.05 on
bookworm) are added to the node image once (``docker run`` + ``docker commit``, cached by tag).
node1 runs munged and slurmctld and is the login node (sshd); every node runs munged and
slurmd. The login user's home is one Docker volume mounted at the same path in every container:
it stands in for the NFS home of a real cluster, so the Python env, env file and run dirs that
``nodeops setup``/``launch`` write through the login node are seen by every compute node.

What a container allows here (found by trying, see ENVIRONMENT.md): no ``--privileged`` (runc
refuses it on this machine) and no writable cgroup tree, so the daemons run with
``ProctrackType=proctrack/linuxproc``, ``TaskPlugin=task/none`` and no accounting; 22.05's slurmd
starts without a cgroup.conf this way. The daemons run in the foreground under their own names
(``slurmctld -D``, ``slurmd -D``). GPUs are faked through ``gres.conf`` on character devices
(``mknod /dev/nvidiaN c 1 3``), so ``--gpus``, ``SLURM_GPUS_ON_NODE`` and
``CUDA_VISIBLE_DEVICES`` behave as on a GPU cluster: node1 has 2, every other node 1.
"""

from __future__ import annotations

import base64
import hashlib
import os
import time
from collections.abc import Callable, Sequence

from nodeops.errors import SandboxError

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge", "openmpi-bin")
IMAGE_REPO = "nodeops-sandbox-slurm"
PARTITION = "main"
KILL_WAIT = 10  # seconds between scancel's SIGTERM and SIGKILL (Slurm's default is 30)
HOME_MOUNT = "/home/debian"

Say = Callable[[str], None]

# Runs once in a container of the node image; the result is committed as the Slurm image.
IMAGE_SETUP = f"""set -eu
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends {" ".join(PACKAGES)} >/tmp/apt.log 2>&1 \\
  || {{ tail -20 /tmp/apt.log; exit 1; }}
rm -rf /var/lib/apt/lists/* /var/cache/apt/archives/*.deb /tmp/apt.log
install -d -o slurm -g slurm /var/spool/slurmctld /var/log/slurm
install -d /var/spool/slurmd
"""


def gpus_of(index: int) -> int:
    """Fake GPUs of node ``index`` (1-based): 2 on node1, 1 elsewhere (uneven, like a real mixed pool)."""
    return 2 if index == 1 else 1


def image_tag(base_id: str) -> str:
    h = hashlib.sha256((base_id + IMAGE_SETUP).encode()).hexdigest()[:12]
    return f"{IMAGE_REPO}:22.05-{h}"


def slurm_conf(cluster: str, nodes: Sequence[tuple[str, str, int]], cpus: int) -> str:
    """slurm.conf for ``nodes`` (``(name, address, gpus)``, the first runs slurmctld)."""
    head, head_addr, _ = nodes[0]
    lines = [
        "# Written by nodeops sandbox up --slurm. A test cluster: no cgroups, no accounting.",
        f"ClusterName={cluster}",
        f"SlurmctldHost={head}({head_addr})",
        "AuthType=auth/munge",
        "SlurmUser=slurm",
        "StateSaveLocation=/var/spool/slurmctld",
        "SlurmdSpoolDir=/var/spool/slurmd",
        "SlurmctldPidFile=/run/slurmctld.pid",
        "SlurmdPidFile=/run/slurmd.pid",
        "SlurmctldLogFile=/var/log/slurm/slurmctld.log",
        "SlurmdLogFile=/var/log/slurm/slurmd.log",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SlurmdParameters=config_overrides",
        "MpiDefault=none",
        "SwitchType=switch/none",
        "ReturnToService=2",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "GresTypes=gpu",
        "AccountingStorageType=accounting_storage/none",
        "JobAcctGatherType=jobacct_gather/none",
        "MailProg=/bin/true",
        f"KillWait={KILL_WAIT}",
        "MinJobAge=300",
        # A requeued job waits cred_expire + 1 s before it may run again (120 s by default, in
        # slurmctld's batch_requeue_fini): a test cluster need not, and its steps start at once.
        "AuthInfo=cred_expire=30",
        "InactiveLimit=0",
        "SchedulerParameters=sched_interval=2",
    ]
    for name, address, gpus in nodes:
        gres = f" Gres=gpu:{gpus}" if gpus else ""
        lines.append(f"NodeName={name} NodeAddr={address} CPUs={cpus}{gres} State=UNKNOWN")
    lines.append(f"PartitionName={PARTITION} Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
    return "\n".join(lines) + "\n"


def gres_conf(gpus: int) -> str:
    if gpus == 0:
        return "# no GPUs on this node\n"
    files = "/dev/nvidia0" if gpus == 1 else f"/dev/nvidia[0-{gpus - 1}]"
    return f"AutoDetect=off\nName=gpu File={files}\n"


def node_script(conf: str, gres: str, key: bytes, gpus: int, controller: bool) -> str:
    """What `docker exec -i CONTAINER bash -s` runs on one node: write the config and the munge
    key, make the fake GPU devices, and start what is not running yet (re-running is harmless)."""

    def put(path: str, content: bytes, owner: str, mode: str) -> str:
        b64 = base64.b64encode(content).decode()
        new = f"{path}.new"
        return f"printf %s {b64} | base64 -d > {new} && chown {owner} {new} && chmod {mode} {new} && mv {new} {path}"

    lines = [
        "set -eu",
        "install -d -m 0755 /etc/slurm",
        "install -d -o munge -g munge -m 0700 /etc/munge",
        "install -d -o munge -g munge -m 0755 /run/munge",
        put("/etc/slurm/slurm.conf", conf.encode(), "root:root", "0644"),
        put("/etc/slurm/gres.conf", gres.encode(), "root:root", "0644"),
        put("/etc/munge/munge.key", key, "munge:munge", "0400"),
    ]
    for i in range(gpus):
        lines.append(f"[ -e /dev/nvidia{i} ] || mknod -m 0666 /dev/nvidia{i} c 1 3")
    lines.append("pgrep -x munged >/dev/null || su -s /bin/sh munge -c '/usr/sbin/munged --force'")
    lines.append("for _ in $(seq 50); do munge -n >/dev/null 2>&1 && break; sleep 0.1; done")
    daemons = ["slurmctld", "slurmd"] if controller else ["slurmd"]
    for d in daemons:
        lines.append(f"pgrep -x {d} >/dev/null || setsid /usr/sbin/{d} -D </dev/null >>/var/log/slurm/{d}.out 2>&1 &")
    return "\n".join(lines) + "\n"


def munge_key(path: str) -> bytes:
    """The sandbox's munge key (made once, 0600 in its state dir): the same on every node."""
    if not os.path.exists(path):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(os.urandom(1024))
    with open(path, "rb") as f:
        return f.read()


def wait_idle(run_in_login: Callable[[str], str], n: int, timeout: float = 90) -> None:
    """Until every node is idle (slurmd registered with slurmctld), or raise with what sinfo says."""
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        last = run_in_login("sinfo -h -N -o '%N %T' 2>&1 || true")
        states = [line.split()[1] for line in last.splitlines() if len(line.split()) == 2]
        if len(states) == n and all(s in ("idle", "mixed", "allocated") for s in states):
            return
        time.sleep(1)
    raise SandboxError(f"Slurm did not come up within {timeout:.0f}s; sinfo says: {last.strip() or 'nothing'}")
