"""A local cluster of real sshd containers, to rehearse on and to test against.

Everything is driven through the ``docker`` CLI (what users and CI scripts already have).
Everything created carries the label ``io.nodeops.sandbox.cluster=<name>``, and ``down`` removes
exactly what carries it, plus the sandbox's state dir.

State dir (``$NODEOPS_HOME/sandbox/<name>``, default ``~/.nodeops``): the keypair
(``id_ed25519``, 0600), ``known_hosts`` with every node's host keys (read from inside the
containers, so they are pinned without trusting the network), ``cluster.yaml`` (an AutoDist
spec, chief first) and ``ssh_config``.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import ipaddress
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from nodeops.errors import NodeopsError, SandboxError
from nodeops.quoting import sh_word
from nodeops.resources import data_dir, nodeops_home
from nodeops.sandbox import slurm as S
from nodeops.setup.render import ssh_config
from nodeops.spec.load import load_spec_text

LABEL = "io.nodeops.sandbox.cluster"
USER = "debian"
PACKAGES = ("openssh-server", "python3", "sudo", "iproute2", "procps", "ca-certificates", "iptables")
DEFAULT_NAME = "nodeops"
DEFAULT_SUBNET = "10.213.0.0/24"
IMAGE_REPO = "nodeops-sandbox-node"
SSH_PORT = 22
FIRST_HOST = 11  # node1 is .11: leaves the gateway (.1) and a few spares alone
_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,30}$")
# sshd runs as a daemon beside a keep-alive, so a test can stop sshd (`kill $(cat /run/sshd.pid)`)
# and restart it (`/usr/sbin/sshd`) without the container going away.
NODE_CMD = ["/bin/sh", "-c", "ssh-keygen -A >/dev/null && /usr/sbin/sshd && exec sleep infinity"]

Say = Callable[[str], None]


@dataclass(frozen=True)
class NodeInfo:
    name: str  # hostname inside the cluster, e.g. node1
    container: str
    address: str
    state: str  # docker's: running, exited, ...


@dataclass(frozen=True)
class Sandbox:
    name: str
    state_dir: Path
    nodes: list[NodeInfo]

    @property
    def spec_path(self) -> Path:
        return self.state_dir / "cluster.yaml"

    @property
    def ssh_config(self) -> Path:
        return self.state_dir / "ssh_config"

    @property
    def inventory_path(self) -> Path:
        """The same nodes as an Ansible inventory (every command takes it in place of the spec)."""
        return self.state_dir / "inventory.yml"


def home() -> Path:
    return nodeops_home()


def state_dir(name: str) -> Path:
    return home() / "sandbox" / name


def network_name(name: str) -> str:
    return f"nodeops-{name}"


def container_name(name: str, i: int) -> str:
    return f"nodeops-{name}-node{i}"


# --------------------------------------------------------------------------- docker plumbing
def docker(*args: str, input: bytes | None = None, timeout: float = 120, check: bool = True) -> str:
    try:
        p = subprocess.run(["docker", *args], input=input, capture_output=True, timeout=timeout, check=False)
    except FileNotFoundError:
        raise SandboxError("the docker CLI is not installed; install docker.io (apt-get install docker.io)") from None
    except subprocess.TimeoutExpired:
        raise SandboxError(f"`docker {' '.join(args[:2])}` did not answer within {timeout:.0f}s") from None
    if check and p.returncode != 0:
        msg = p.stderr.decode(errors="replace").strip() or p.stdout.decode(errors="replace").strip()
        raise SandboxError(f"`docker {' '.join(args[:3])}` failed: {msg}")
    return p.stdout.decode(errors="replace")


def ensure_engine() -> None:
    try:
        docker("info", "--format", "{{.ServerVersion}}", timeout=20)
    except SandboxError as e:
        raise SandboxError(
            "no Docker engine answers. Start one (as root: `dockerd &`, or `bash scripts/ensure-docker.sh` "
            f"from a nodeops checkout) and retry. ({e})"
        ) from None


def image_exists(image: str) -> bool:
    return docker("image", "inspect", image, check=False, timeout=30).strip() not in ("", "[]")


def recipe_hash() -> str:
    """Hash of everything that defines the node image; part of its tag, so edits rebuild it."""
    h = hashlib.sha256(" ".join(PACKAGES).encode())
    for f in ("Dockerfile", "node-setup.sh"):
        h.update((data_dir("templates") / "sandbox" / f).read_bytes())
    return h.hexdigest()[:12]


def default_image() -> str:
    return f"{IMAGE_REPO}:bookworm-{recipe_hash()}"


def apt_mirror(sources: Path = Path("/etc/apt/sources.list.d/debian.sources")) -> str:
    """The Debian mirror this machine uses (the first ``URIs:`` line), for debootstrap."""
    if sources.is_file():
        for line in sources.read_text().splitlines():
            if line.startswith("URIs:") and line.split()[1:]:
                return line.split()[1]
    legacy = Path("/etc/apt/sources.list")
    if legacy.is_file():
        for line in legacy.read_text().splitlines():
            parts = line.split()
            if parts[:1] == ["deb"] and len(parts) > 1:
                return parts[2] if parts[1].startswith("[") else parts[1]
    raise SandboxError(f"cannot find a Debian mirror in {sources} or {legacy}; pass --image to use your own image")


def _build_dockerfile(image: str) -> None:
    ctx = data_dir("templates") / "sandbox"
    docker("build", "-q", "--build-arg", f"PACKAGES={' '.join(PACKAGES)}", "-t", image, str(ctx), timeout=900)


def _build_debootstrap(image: str, say: Say) -> None:
    if shutil.which("debootstrap") is None:
        raise SandboxError("no registry reachable and debootstrap is missing: apt-get install debootstrap")
    if os.geteuid() != 0:
        raise SandboxError("building the node image with debootstrap needs root: run `sudo nodeops sandbox up` once")
    mirror = apt_mirror()
    with tempfile.TemporaryDirectory(prefix="nodeops-rootfs-") as tmp:
        root = Path(tmp) / "rootfs"
        say(f"building {image} with debootstrap from {mirror} (about a minute, once)")
        cmd = ["debootstrap", "--variant=minbase", f"--include={','.join(PACKAGES)}", "bookworm", str(root), mirror]
        p = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if p.returncode != 0:
            tail = "\n".join((p.stdout + p.stderr).strip().splitlines()[-5:])
            raise SandboxError(f"debootstrap failed (exit {p.returncode}):\n{tail}")
        setup = root / "tmp" / "node-setup.sh"
        shutil.copy(data_dir("templates") / "sandbox" / "node-setup.sh", setup)
        p = subprocess.run(
            ["chroot", str(root), "/bin/sh", "/tmp/node-setup.sh", USER, "1000"],
            capture_output=True,
            text=True,
            check=False,
        )
        if p.returncode != 0:
            raise SandboxError(f"node-setup.sh failed in the chroot: {p.stderr.strip()}")
        setup.unlink()
        tar = subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE)
        cmd_json = '["' + '", "'.join(NODE_CMD) + '"]'
        imp = subprocess.run(
            ["docker", "import", "--change", f"CMD {cmd_json}", "-", image],
            stdin=tar.stdout,
            capture_output=True,
            check=False,
        )
        assert tar.stdout is not None
        tar.stdout.close()
        tar.wait()
        if imp.returncode != 0 or tar.returncode != 0:
            raise SandboxError(f"docker import failed: {imp.stderr.decode(errors='replace').strip()}")


def ensure_slurm_image(base: str, say: Say) -> str:
    """The Slurm variant of the node image ``base`` (Debian's Slurm packages added), built once."""
    tag = S.image_tag(docker("image", "inspect", "--format", "{{.Id}}", base).strip())
    if image_exists(tag):
        return tag
    say(f"building {tag}: Debian's {', '.join(S.PACKAGES)} on {base} (once)")
    builder = f"nodeops-build-{os.getpid()}"
    try:
        docker("run", "--name", builder, "--label", f"{LABEL}.build=1", base, "bash", "-c", S.IMAGE_SETUP, timeout=900)
        cmd_json = '["' + '", "'.join(NODE_CMD) + '"]'
        docker("commit", "--change", f"CMD {cmd_json}", builder, tag, timeout=300)
    finally:
        docker("rm", "-f", builder, check=False)
    return tag


def ensure_image(image: str | None, build: str, say: Say) -> str:
    """Return a usable node image tag, building the default one once if needed.

    ``build``: ``auto`` tries a Dockerfile build on ``debian:bookworm-slim`` when a registry
    answers, else debootstrap; ``dockerfile`` and ``debootstrap`` force one path.
    """
    if image is not None:
        if not image_exists(image):
            say(f"pulling {image}")
            docker("pull", image, timeout=600)
        return image
    tag = default_image()
    if image_exists(tag):
        return tag
    use_dockerfile = build == "dockerfile"
    if build == "auto":
        use_dockerfile = image_exists("debian:bookworm-slim") or (
            docker("pull", "debian:bookworm-slim", check=False, timeout=60) != ""
        )
    if use_dockerfile:
        say(f"building {tag} from debian:bookworm-slim")
        _build_dockerfile(tag)
    else:
        _build_debootstrap(tag, say)
    docker("tag", tag, f"{IMAGE_REPO}:latest")  # a stable name for molecule and users
    return tag


# --------------------------------------------------------------------------- queries
def nodes(name: str) -> list[NodeInfo]:
    """The sandbox's containers, found by label, in node order."""
    out = docker("ps", "-a", "--filter", f"label={LABEL}={name}", "--format", "{{.Names}}")
    names = out.split()
    if not names:
        return []
    fmt = (
        '{{.Name}}|{{index .Config.Labels "' + LABEL + '.node"}}|{{.State.Status}}|'
        "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}"
    )
    rows = [line.split("|") for line in docker("inspect", "--format", fmt, *names).splitlines() if line]
    found = [NodeInfo(name=r[1], container=r[0].lstrip("/"), state=r[2], address=r[3]) for r in rows]
    return sorted(found, key=lambda n: int(n.name.removeprefix("node") or 0))


def volumes(name: str) -> list[str]:
    return docker("volume", "ls", "--filter", f"label={LABEL}={name}", "--format", "{{.Name}}").split()


def home_volume(name: str) -> str:
    return f"nodeops-{name}-home"


def is_slurm(name: str) -> bool:
    """Whether the sandbox was made with --slurm (its containers carry the label)."""
    out = docker("ps", "-a", "--filter", f"label={LABEL}={name}", "--filter", f"label={LABEL}.slurm=1", "-q")
    return bool(out.split())


def networks(name: str) -> list[str]:
    return docker("network", "ls", "--filter", f"label={LABEL}={name}", "--format", "{{.Name}}").split()


def all_sandboxes() -> list[str]:
    out = docker("ps", "-a", "--filter", f"label={LABEL}", "--format", f'{{{{.Label "{LABEL}"}}}}')
    nets = docker("network", "ls", "--filter", f"label={LABEL}", "--format", f'{{{{.Label "{LABEL}"}}}}')
    dirs = [p.name for p in (home() / "sandbox").iterdir()] if (home() / "sandbox").is_dir() else []
    return sorted(set(out.split()) | set(nets.split()) | set(dirs))


# --------------------------------------------------------------------------- up / down
def _check_args(name: str, n: int, subnet: str) -> list[str]:
    if not _NAME.match(name):
        raise SandboxError(f"sandbox name {name!r}: use lowercase letters, digits, '-' and '_' (max 31)")
    try:
        net = ipaddress.ip_network(subnet)
    except ValueError as e:
        raise SandboxError(f"--subnet {subnet!r} is not a network: {e}") from None
    if net.version != 4:
        raise SandboxError(f"--subnet {subnet}: use an IPv4 network such as {DEFAULT_SUBNET}")
    hosts = list(net.hosts())
    if n < 1 or FIRST_HOST - 1 + n > len(hosts):
        raise SandboxError(f"-n {n}: {subnet} fits 1 to {max(len(hosts) - FIRST_HOST + 1, 0)} nodes")
    return [str(hosts[FIRST_HOST - 2 + i]) for i in range(1, n + 1)]


def shared_mounts(shared: Sequence[tuple[Path, str]]) -> list[str]:
    """``docker run`` arguments that bind each dir read-only at its path in the nodes."""
    args: list[str] = []
    for src, dest in shared:
        if not src.is_absolute() or not dest.startswith("/") or "," in f"{src}{dest}":
            raise SandboxError(f"shared dir {src} -> {dest}: give absolute paths without ','")
        if dest.rstrip("/") in ("", "/home", f"/home/{USER}", "/etc", "/usr", "/tmp"):
            raise SandboxError(f"shared dir {src} -> {dest}: mount it elsewhere (e.g. /opt/shared), not over {dest}")
        args += ["--mount", f"type=bind,source={src},target={dest},readonly"]
    return args


def _wait_for_sshd(address: str, deadline: float) -> None:
    while True:
        try:
            with socket.create_connection((address, SSH_PORT), timeout=1) as s:
                if s.recv(4).startswith(b"SSH-"):
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise SandboxError(f"sshd on {address} did not answer within the timeout")
        time.sleep(0.1)


def _host_keys(container: str, deadline: float) -> list[str]:
    while True:
        out = docker("exec", container, "sh", "-c", "cat /etc/ssh/ssh_host_*_key.pub 2>/dev/null", check=False)
        keys = [" ".join(line.split()[:2]) for line in out.splitlines() if line.strip()]
        if len(keys) >= 3 or time.monotonic() > deadline:
            if not keys:
                raise SandboxError(f"{container}: no ssh host keys were generated")
            return keys
        time.sleep(0.1)


def _authorize(container: str, pubkey: str) -> None:
    # Additive and idempotent: append the key only if that exact line is not there yet.
    script = (
        f'd=~{USER}/.ssh; install -d -m 700 -o {USER} -g {USER} "$d"; k=$(cat); '
        'f="$d/authorized_keys"; touch "$f"; grep -qxF "$k" "$f" || printf "%s\\n" "$k" >> "$f"; '
        f'chown {USER}:{USER} "$f"; chmod 600 "$f"'
    )
    docker("exec", "-i", container, "sh", "-c", script, input=pubkey.encode())


def spec_text(name: str, node_list: Sequence[NodeInfo], sdir: Path, slurm: bool = False) -> str:
    """The sandbox as a resource spec. ``slurm``: only the login node (node1) is listed; the job's
    nodes come from Slurm (``slurm.nodes``; fake GPUs 2+1+1..., asked for as a total)."""
    lines = [
        f"# nodeops sandbox '{name}': {len(node_list)} sshd containers on this machine"
        + (" running Slurm (node1: slurmctld and the login node)." if slurm else "."),
        f"# Remove with: nodeops sandbox down --name {name}",
        f"name: {name}",
    ]
    if slurm:
        gpus = sum(S.gpus_of(i) for i in range(1, len(node_list) + 1))
        lines += ["slurm:", "  login: node1", f"  partition: {S.PARTITION}", f"  nodes: {len(node_list)}",
                  f"  gpus: {gpus}", "  time: '00:30:00'"]  # fmt: skip
        node_list = node_list[:1]
    lines.append("nodes:")
    for i, node in enumerate(node_list):
        lines += [f"  - address: {node.address}", f"    name: {node.name}", "    cpus: [0]"]
        if i == 0:
            lines.append("    chief: true")
        lines.append("    ssh_config: sandbox")
    lines += [
        "ssh:",
        "  sandbox:",
        f"    username: {USER}",
        f"    key_file: {sdir / 'id_ed25519'}",
        f"    port: {SSH_PORT}",
        f"    known_hosts: {sdir / 'known_hosts'}",
    ]
    return "\n".join(lines) + "\n"


def inventory_text(name: str, node_list: Sequence[NodeInfo], sdir: Path) -> str:
    """The sandbox as a plain Ansible inventory: the spec's nodes, user, key and pinned host keys."""
    import yaml

    inv = {"all": {
        "vars": {"ansible_user": USER, "ansible_port": SSH_PORT,
                 "ansible_ssh_private_key_file": str(sdir / "id_ed25519"),
                 "ansible_ssh_common_args": "-o UserKnownHostsFile=" + sh_word(str(sdir / "known_hosts")),
                 "nodeops": {"name": name}},
        "hosts": {n.name: {"ansible_host": n.address} for n in node_list},
        "children": {"chief": {"hosts": {node_list[0].name: None}}},
    }}  # fmt: skip
    head = (f"# nodeops sandbox '{name}' as an Ansible inventory (the nodes of cluster.yaml beside it).\n"
            f"# Remove with: nodeops sandbox down --name {name}\n")  # fmt: skip
    return head + yaml.safe_dump(inv, sort_keys=False)


def used_subnets() -> list[ipaddress.IPv4Network]:
    """IPv4 networks already taken on this machine: every Docker network's subnets and the
    host's own routes (a sandbox there would shadow a real network)."""
    found: list[str] = []
    ids = docker("network", "ls", "-q").split()
    if ids:
        fmt = "{{range .IPAM.Config}}{{.Subnet}} {{end}}"
        found += docker("network", "inspect", "--format", fmt, *ids).split()
    try:
        routes = subprocess.run(["ip", "-4", "route", "show"], capture_output=True, text=True, check=False).stdout
    except OSError:  # no iproute2 here: Docker's own networks are what can overlap
        routes = ""
    found += [line.split()[0] for line in routes.splitlines() if line and line.split()[0][0].isdigit()]
    out: list[ipaddress.IPv4Network] = []
    for text in found:
        try:
            net = ipaddress.ip_network(text, strict=False)
        except ValueError:
            continue
        if isinstance(net, ipaddress.IPv4Network):
            out.append(net)
    return out


def free_subnet(used: Sequence[ipaddress.IPv4Network], start: str = DEFAULT_SUBNET, tries: int = 256) -> str:
    """The first /24 from ``start`` on (10.213.0.0/24, 10.213.1.0/24, ...) that overlaps nothing in ``used``."""
    base = ipaddress.ip_network(start)
    for i in range(tries):
        cand = ipaddress.ip_network((int(base.network_address) + i * 256, 24))
        if not any(cand.overlaps(u) for u in used):
            return str(cand)
    raise SandboxError(f"no free /24 from {start} on ({tries} tried); pass --subnet")


def existing_subnet(name: str) -> str | None:
    """The subnet of this sandbox's network, if it exists."""
    if not networks(name):
        return None
    fmt = "{{range .IPAM.Config}}{{.Subnet}} {{end}}"
    subnets = docker("network", "inspect", "--format", fmt, network_name(name)).split()
    return subnets[0] if subnets else None


def bytes_sent(name: str) -> int:
    """Bytes this machine (the controller) has sent into the sandbox's network so far: the
    transmit counter of the network's Linux bridge. Node-to-node traffic is switched between
    the containers' ports and never counts."""
    net_id = docker("network", "inspect", "--format", "{{.Id}}", network_name(name)).strip()
    counter = Path("/sys/class/net") / f"br-{net_id[:12]}" / "statistics" / "tx_bytes"
    try:
        return int(counter.read_text())
    except (OSError, ValueError) as e:
        raise SandboxError(f"cannot read {counter}, the byte counter of sandbox {name}'s bridge: {e}") from None


NEIGH = Path("/proc/sys/net/ipv4/neigh/default")


def neighbour_room(n: int, neigh: Path = NEIGH) -> tuple[int, int] | None:
    """Every node of a sandbox is a container on this one kernel, whose neighbour (ARP) table has
    one limit for all of them (``gc_thresh3``, 1024 by default). A job whose ranks connect to each
    other (gloo's and NCCL's full mesh) fills n*(n-1) entries: past the limit the kernel says
    "neighbor table overflow" and new connections fail with "No route to host" (64 nodes: 4,032).
    (the limit now, the one ``n`` nodes need), or None when there is room (or no such file)."""
    try:
        now = int((neigh / "gc_thresh3").read_text())
    except (OSError, ValueError):
        return None
    need = n * (n - 1) + 512  # the mesh, and room for this machine's own neighbours
    return None if now >= need else (now, need)


def make_neighbour_room(n: int, say: Say, neigh: Path = NEIGH) -> None:
    """Raise this kernel's neighbour-table limits for an ``n``-node sandbox's full mesh (as root;
    only ever upwards, until the next boot), or say why a big job's connections may fail."""
    room = neighbour_room(n, neigh)
    if room is None:
        return
    now, need = room
    try:
        for knob, value in (("gc_thresh1", need // 4), ("gc_thresh2", need), ("gc_thresh3", 2 * need)):
            if int((neigh / knob).read_text()) < value:
                (neigh / knob).write_text(str(value))
    except (OSError, ValueError) as e:
        say(f"warning: {n} nodes on one kernel need about {need} neighbour (ARP) entries for a full mesh, "
            f"and net.ipv4.neigh.default.gc_thresh3 is {now}: a job whose ranks all connect to each other "
            f"will fail with 'No route to host'. As root: sysctl -w net.ipv4.neigh.default.gc_thresh3={2 * need} "
            f"({e.__class__.__name__})")  # fmt: skip
        return
    say(f"raised net.ipv4.neigh.default.gc_thresh3 from {now} to {2 * need} (until reboot): {n} nodes on one "
        f"kernel share its neighbour table, and a full mesh fills about {need} entries")  # fmt: skip


def up(
    name: str = DEFAULT_NAME,
    n: int = 3,
    subnet: str | None = None,
    image: str | None = None,
    build: str = "auto",
    say: Say = lambda _m: None,
    slurm: bool = False,
    shared: Sequence[tuple[Path, str]] = (),
) -> Sandbox:
    """Create (or re-verify) the sandbox. On failure, remove what this call created and raise.

    ``subnet=None``: the sandbox's own subnet when it exists, else the first free /24 from
    10.213.0.0/24 on (said through ``say``), so a second sandbox never hits "Pool overlaps".
    ``shared``: (dir on this machine, path in the nodes) pairs, bind-mounted read-only into every
    node, as a cluster's shared filesystem holds one prepared env for all its nodes."""
    mount_args = shared_mounts(shared)
    if subnet is not None:
        _check_args(name, n, subnet)
    ensure_engine()
    if subnet is None:
        subnet = existing_subnet(name)
        if subnet is None:
            subnet = free_subnet(used_subnets())
            say(f"using subnet {subnet} (the first free /24 from {DEFAULT_SUBNET}; choose one with --subnet)")
    addresses = _check_args(name, n, subnet)
    make_neighbour_room(n, say)
    existing = nodes(name)
    if existing and len(existing) != n:
        raise SandboxError(
            f"sandbox {name!r} already has {len(existing)} node(s); run `nodeops sandbox down --name {name}` first"
        )
    if existing and is_slurm(name) != slurm:
        kind = "a Slurm" if not slurm else "an ssh-only"
        raise SandboxError(f"sandbox {name!r} exists as {kind} sandbox; run `nodeops sandbox down --name {name}` first")
    created_containers: list[str] = []
    created_network = False
    created_volume = ""
    sdir = state_dir(name)
    created_dir = not sdir.exists()
    try:
        tag = ensure_image(image, build, say)
        extra: list[str] = list(mount_args)
        if slurm:
            tag = ensure_slurm_image(tag, say)
            vol = home_volume(name)
            if vol not in volumes(name):
                docker("volume", "create", "--label", f"{LABEL}={name}", vol)
                created_volume = vol
            # the login user's home, shared by every node as NFS homes are on a real cluster
            extra += ["--label", f"{LABEL}.slurm=1", "-v", f"{vol}:/home/{USER}"]
        net = network_name(name)
        if not networks(name):
            say(f"creating network {net} ({subnet})")
            docker("network", "create", "--subnet", subnet, "--label", f"{LABEL}={name}", net)
            created_network = True
        elif existing and existing[0].address and existing[0].address not in addresses:
            raise SandboxError(f"sandbox {name!r} exists on another subnet; run `nodeops sandbox down --name {name}`")
        by_name = {nd.name: nd for nd in existing}
        for i, address in enumerate(addresses, start=1):
            host = f"node{i}"
            if host in by_name:
                if by_name[host].state != "running":
                    say(f"starting {by_name[host].container}")
                    docker("start", by_name[host].container)
                continue
            cname = container_name(name, i)
            say(f"starting {cname} at {address}")
            # counted before `docker run`: one interrupted there (Ctrl-C, SIGTERM) is removed too
            created_containers.append(cname)
            docker(
                "run", "-d", "--init", "--name", cname, "--hostname", host,
                "--network", net, "--ip", address, "--network-alias", host,
                "--label", f"{LABEL}={name}", "--label", f"{LABEL}.node={host}",
                "--cap-add", "NET_ADMIN", "--shm-size", "1g", *extra,
                tag, *NODE_CMD,
            )  # fmt: skip
        sdir.mkdir(parents=True, exist_ok=True, mode=0o700)
        (Path.home() / ".ssh").mkdir(mode=0o700, exist_ok=True)  # ssh_config's ControlPath lives there
        os.chmod(sdir, 0o700)
        key = sdir / "id_ed25519"
        if not key.exists():
            subprocess.run(
                ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"nodeops-sandbox-{name}", "-f", str(key)],
                check=True, capture_output=True,
            )  # fmt: skip
        os.chmod(key, 0o600)
        pubkey = (sdir / "id_ed25519.pub").read_text().strip()
        node_list = nodes(name)
        deadline = time.monotonic() + 60
        known: list[str] = []

        if slurm:  # one shared home: authorize once, not from every node at the same time
            _authorize(node_list[0].container, pubkey)

        def prepare(node: NodeInfo) -> list[str]:
            if not slurm:
                _authorize(node.container, pubkey)
            keys = _host_keys(node.container, deadline)
            _wait_for_sshd(node.address, deadline)
            return [f"{node.address},{node.name} {k}" for k in keys]

        with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
            for lines in pool.map(prepare, node_list):
                known += lines
        (sdir / "known_hosts").write_text("\n".join(known) + "\n")
        sb = Sandbox(name=name, state_dir=sdir, nodes=node_list)
        if slurm:
            say("starting munged, slurmctld (node1) and slurmd (every node)")
            start_slurm(name, node_list, sdir)
        sb.spec_path.write_text(spec_text(name, node_list, sdir, slurm=slurm))
        sb.inventory_path.write_text(inventory_text(name, node_list, sdir))
        _write_ssh_config(sb)
        verify(sb)
        return sb
    except BaseException as e:
        for c in reversed(created_containers):
            docker("rm", "-f", c, check=False)
        if created_network:
            docker("network", "rm", network_name(name), check=False)
        if created_volume:
            docker("volume", "rm", "-f", created_volume, check=False)
        if created_dir:
            shutil.rmtree(sdir, ignore_errors=True)
        if isinstance(e, NodeopsError | KeyboardInterrupt):
            raise
        raise SandboxError(f"sandbox up failed: {e}") from e


def start_slurm(name: str, node_list: Sequence[NodeInfo], sdir: Path) -> None:
    """Configure Slurm on every node and start its daemons (what is already running stays), then
    wait until every node is idle."""
    key = S.munge_key(str(sdir / "munge.key"))
    table = [(nd.name, nd.address, S.gpus_of(i)) for i, nd in enumerate(node_list, start=1)]
    cpus = os.cpu_count() or 1
    conf = S.slurm_conf(name, table, cpus)

    def one(i: int) -> str:
        node = node_list[i]
        script = S.node_script(conf, S.gres_conf(table[i][2]), key, table[i][2], controller=i == 0)
        return docker("exec", "-i", node.container, "bash", "-s", input=script.encode(), timeout=60)

    with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(one, range(len(node_list))))
    login = node_list[0].container
    S.wait_idle(lambda cmd: docker("exec", "-u", USER, login, "sh", "-c", cmd, check=False), len(node_list))


def _write_ssh_config(sb: Sandbox) -> None:
    """Every node, also where the spec lists only the Slurm login node."""
    text = spec_text(sb.name, sb.nodes, sb.state_dir)
    sb.ssh_config.write_text(ssh_config(load_spec_text(text, str(sb.spec_path))))


def verify(sb: Sandbox) -> None:
    """ssh to every node as a user would (strict host keys, BatchMode) and run `sudo -n true`."""

    def check(node: NodeInfo) -> str | None:
        p = subprocess.run(
            ["ssh", "-F", str(sb.ssh_config), "-o", "ConnectTimeout=10", node.name, "sudo", "-n", "true"],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        return None if p.returncode == 0 else f"{node.name} ({node.address}): {p.stderr.strip()}"

    with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
        problems = [p for p in pool.map(check, sb.nodes) if p]
    if problems:
        raise SandboxError("ssh check failed: " + "; ".join(problems))


def _close_masters(ssh_config: Path, hosts: list[str]) -> None:
    """End ControlPersist masters, so a new sandbox on the same addresses never reuses a dead one."""
    if not ssh_config.is_file():
        return
    for host in hosts:
        subprocess.run(["ssh", "-F", str(ssh_config), "-O", "exit", host], capture_output=True, timeout=10, check=False)


def get(name: str = DEFAULT_NAME) -> Sandbox:
    ensure_engine()
    return Sandbox(name=name, state_dir=state_dir(name), nodes=nodes(name))


def down(name: str = DEFAULT_NAME) -> list[str]:
    """Remove the sandbox's containers, network and state dir. Returns what was removed."""
    if not _NAME.match(name):
        raise SandboxError(f"sandbox name {name!r}: use lowercase letters, digits, '-' and '_' (max 31)")
    ensure_engine()
    removed: list[str] = []
    nodes_before = nodes(name)
    containers = [nd.container for nd in nodes_before]
    if containers:
        docker("rm", "-f", *containers)
        removed += [f"container {c}" for c in containers]
    for net in networks(name):
        docker("network", "rm", net)
        removed.append(f"network {net}")
    for vol in volumes(name):
        docker("volume", "rm", "-f", vol)
        removed.append(f"volume {vol}")
    sdir = state_dir(name)
    if sdir.exists():
        _close_masters(sdir / "ssh_config", [nd.name for nd in nodes_before])
        shutil.rmtree(sdir)
        removed.append(f"state dir {sdir}")
    return removed
