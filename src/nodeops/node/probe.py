"""The preflight probe that ``nodeops check`` runs on the cluster (stdlib only, Python >= 3.8).

This file is shipped as source: the controller pipes ``{"source": <this file>, "plan": ...}``
to ``python3 -c BOOT`` over ssh on the chief. On the chief (``mode: chief``) it

1. listens on the master and rendezvous ports (a port already taken is itself a finding),
2. pipes the same source to every node over ssh from the chief, in BatchMode with strict host
   keys (the path mpirun and DeepSpeed's pdsh take), the chief itself included,
3. gathers each node's facts (``mode: node``): a real TCP connect to each chief port that
   exchanges a nonce and the chief's clock, the interface its route to the chief uses, the
   Python env's versions and packages, GPUs, workdir content hash, limits and disk,
4. prints one JSON document after ``@@nodeops-check``.

Nothing here judges: ``nodeops.check.preflight`` turns facts into ok/warn/fail on the controller. No
environment value is reported except the socket interface names.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import resource
import shlex
import socket
import subprocess
import sys
import threading
import time
from typing import Any

MARK = "@@nodeops-check "
ENV_MARK = "@@nodeops-env "
BOOT = (
    "import json,sys;d=json.load(sys.stdin);g={'__name__':'nodeops_probe'};"
    "exec(compile(d['source'],'nodeops-probe','exec'),g);g['main'](d)"
)
CONNECT_TIMEOUT = 3.0
# srun forwards a task's output in messages of at most 1,024 bytes (Slurm's MAX_MSG_LEN), so a
# longer line arrives cut and its pieces may interleave with other tasks' lines; a probe's
# document is therefore written as numbered frames, each line well under that size.
FRAME = 900
FANOUT = 64  # nodes the chief probes at once
HASH_BUDGET = 2 << 30  # bytes read for the workdir hash; beyond it, size+mtime stand in for content

# Runs inside the activated env: what torch, the interpreter and the packages are.
ENV_SCRIPT = r"""
import json, os, platform, resource, sys
out = {"python": platform.python_version(), "executable": sys.executable,
       "nofile": list(resource.getrlimit(resource.RLIMIT_NOFILE)),
       "env_prefix": os.environ.get("VIRTUAL_ENV") or os.environ.get("CONDA_PREFIX") or "",
       "ifnames": {k: os.environ.get(k) for k in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")}}
try:
    import importlib.metadata as md
    out["packages"] = {(d.metadata["Name"] or "").lower(): d.version for d in md.distributions() if d.metadata["Name"]}
except Exception as e:  # noqa: BLE001
    out["packages_error"] = str(e)
def torch_versions():  # launch's preflight: torch's version.py read as text, not imported (slow)
    import importlib.util, re
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("No module named 'torch'")
    text = open(os.path.join(list(spec.submodule_search_locations)[0], "version.py")).read()
    ver = re.search(r"^__version__\s*=\s*'([^']*)'", text, re.M)
    cuda = re.search(r"^cuda(?::[^=]*)?=\s*'([^']*)'", text, re.M)
    out["torch"] = ver.group(1) if ver else "unknown"
    out["torch_cuda"] = cuda.group(1) if cuda else None
def torch_full():
    import torch
    out["torch"] = torch.__version__
    out["torch_cuda"] = torch.version.cuda
    out["cuda_devices"] = torch.cuda.device_count()
    try:
        v = torch.cuda.nccl.version() if torch.cuda.is_available() else None
        out["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else (str(v) if v else None)
    except Exception:  # noqa: BLE001
        out["nccl"] = None
import shutil
# the runner's own commands (mpirun, deepspeed, pdsh), looked up as the job would find them
out["commands"] = {c: shutil.which(c) or "" for c in os.environ.get("NODEOPS_PROBE_COMMANDS", "").split()}
try:
    (torch_versions if os.environ.get("NODEOPS_PROBE_FAST") == "1" else torch_full)()
except Exception as e:  # noqa: BLE001
    out["torch_error"] = type(e).__name__ + ": " + str(e)
print("@@nodeops-env " + json.dumps(out))
"""

NVIDIA_QUERY = "index,uuid,name,driver_version,memory.total"


def parse_nvidia_smi(text: str) -> list[dict[str, object]]:
    """Rows of ``nvidia-smi --query-gpu=index,uuid,name,driver_version,memory.total
    --format=csv,noheader,nounits``."""
    gpus: list[dict[str, object]] = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 5 or not parts[0].isdigit():
            continue
        mem = parts[4]
        gpus.append({"index": int(parts[0]), "uuid": parts[1], "name": parts[2], "driver": parts[3],
                     "memory_mib": int(mem) if mem.isdigit() else None})  # fmt: skip
    return gpus


def tree_hash(root: str, exclude: list[str], budget: int = HASH_BUDGET) -> dict[str, object]:
    """A content hash of a directory tree: paths, symlink targets and file bytes, in a fixed
    order. Names in ``exclude`` are skipped at any depth (what setup's rsync skips)."""
    h = hashlib.sha256()
    files = size = 0
    read = 0
    exact = True
    skip = set(exclude)
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip)
        rel_dir = os.path.relpath(dirpath, root)
        for name in sorted(filenames):
            if name in skip:
                continue
            path = os.path.join(dirpath, name)
            rel = os.path.normpath(os.path.join(rel_dir, name))
            st = os.lstat(path)
            h.update(rel.encode("utf-8", "surrogateescape") + b"\0")
            if os.path.islink(path):
                h.update(b"L" + os.readlink(path).encode("utf-8", "surrogateescape") + b"\0")
                continue
            files += 1
            size += st.st_size
            if read + st.st_size > budget:
                exact = False
                h.update(b"S%d:%d\0" % (st.st_size, int(st.st_mtime)))
                continue
            read += st.st_size
            try:
                with open(path, "rb") as f:
                    for block in iter(lambda: f.read(1 << 20), b""):
                        h.update(block)
            except OSError as e:
                h.update(b"E" + str(e.errno).encode())
    return {"hash": h.hexdigest()[:16], "files": files, "bytes": size, "exact": exact}


def _run(
    argv: list[str], timeout: float, stdin: str | None = None, env: dict[str, str] | None = None
) -> tuple[int, str, str]:
    try:
        p = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=timeout, errors="replace",
                           env=env)  # fmt: skip
    except FileNotFoundError:
        return 127, "", argv[0] + ": not found"
    except subprocess.TimeoutExpired:
        return 124, "", f"timed out after {timeout:.0f}s"
    return p.returncode, p.stdout, p.stderr


def resolve(address: str) -> str:
    """``address`` as an IP address (a DNS name resolved here, as the ranks will); as given where
    it cannot be (``ip route get`` then says why)."""
    try:
        return str(socket.getaddrinfo(address, None)[0][4][0])
    except (OSError, IndexError, UnicodeError):
        return address


def route_to(address: str, subnet: bool = True) -> dict[str, object]:
    """The interface (and source address) this node uses to reach ``address``, and, with
    ``subnet``, the subnet of that interface's address (``net``: where the neighbours are)."""
    address = resolve(address)
    rc, out, err = _run(["ip", "-j", "route", "get", address], 5)
    if rc != 0:
        return {"error": (err.strip() or "ip route get failed").splitlines()[-1]}
    try:
        r = json.loads(out)[0]
    except (ValueError, IndexError):
        return {"error": "cannot parse `ip -j route get` output"}
    dev, src = r.get("dev", ""), r.get("prefsrc", "")
    links: list[dict[str, Any]] = []
    if dev == "lo" or subnet:
        rc, out, _ = _run(["ip", "-j", "addr", "show"], 5)
        try:
            links = [x for x in json.loads(out) if isinstance(x, dict)] if rc == 0 else []
        except (ValueError, TypeError):  # an iproute2 whose JSON is broken: no subnet, not a failed probe
            links = []
    if dev == "lo":  # the chief reaching itself: name the interface that holds the address
        for link in links:
            if any(a.get("local") == address for a in link.get("addr_info", [])):
                dev, src = link.get("ifname", dev), address
    net = ""  # the subnet of that interface's address: the peers in it are neighbours
    for link in links:
        for a in link.get("addr_info", []) if link.get("ifname") == dev else []:
            if a.get("local") == src and a.get("prefixlen") is not None:
                net = f"{src}/{a['prefixlen']}"
    return {"dev": dev, "src": src, "net": net}


def neighbour_limit(address: str) -> dict[str, object] | None:
    """The kernel's hard limit on neighbour (ARP/NDP) entries (``gc_thresh3``) for ``address``'s
    family, and the family; None where this network namespace does not show it (a container: the
    host's applies)."""
    family = "ipv6" if ":" in address else "ipv4"
    try:
        with open(f"/proc/sys/net/{family}/neigh/default/gc_thresh3") as f:
            return {"limit": int(f.read()), "family": family}
    except (OSError, ValueError):
        return None


def connect(address: str, port: int, nonce: str, name: str) -> dict[str, object]:
    """A real connect to the chief's listener: send the nonce, read back the chief's clock."""
    t0 = time.time()
    try:
        with socket.create_connection((address, port), timeout=CONNECT_TIMEOUT) as s:
            s.sendall(f"nodeops-check {nonce} {name}\n".encode())
            data = b""
            while not data.endswith(b"\n"):
                chunk = s.recv(256)
                if not chunk:
                    break
                data += chunk
    except TimeoutError:
        return {"ok": False, "error": f"connect to {address}:{port} timed out after {CONNECT_TIMEOUT:.0f}s"}
    except OSError as e:
        return {"ok": False, "error": f"connect to {address}:{port}: {e.strerror or e}"}
    t1 = time.time()
    parts = data.decode(errors="replace").split()
    if len(parts) != 2 or parts[0] != nonce:
        return {"ok": False, "error": f"{address}:{port} answered, but not nodeops' listener (another service?)"}
    return {
        "ok": True,
        "rtt_ms": round((t1 - t0) * 1000, 2),
        "offset_s": round(t0 + (t1 - t0) / 2 - float(parts[1]), 4),
    }


def env_facts(plan: dict[str, Any]) -> dict[str, Any]:
    """Activate the env the way a job does (env file, then activation) and ask Python."""
    script = "set -e\n"
    if plan.get("workdir"):
        script += f"cd {shlex.quote(plan['workdir'])} 2>/dev/null || true\n"
    env_file = plan.get("env_file")
    if env_file:
        script += f'if [ -r "$HOME/{env_file}" ]; then . "$HOME/{env_file}"; fi\n'
    if plan.get("activate"):
        script += plan["activate"] + "\n"
    script += 'exec python3 -c "$1"\n'
    env = dict(
        os.environ,
        NODEOPS_PROBE_FAST="1" if plan.get("fast") else "0",
        NODEOPS_PROBE_COMMANDS=" ".join(plan.get("commands") or []),
    )
    rc, out, err = _run(["bash", "-c", script, "bash", ENV_SCRIPT], 120, env=env)
    for line in out.splitlines():
        if line.startswith(ENV_MARK):
            doc: dict[str, Any] = json.loads(line[len(ENV_MARK) :])
            return doc
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    return {"error": (lines[-1] if lines else f"exit {rc}"), "exit": rc}


def node_facts(plan: dict[str, Any]) -> dict[str, Any]:
    f: dict[str, Any] = {"hostname": socket.gethostname()}
    if os.environ.get("SLURMD_NODENAME"):  # in a Slurm step: the node's name as Slurm knows it
        f["slurm_node"] = os.environ["SLURMD_NODENAME"]
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    f["nofile"] = [soft, hard]
    try:
        st = os.statvfs("/dev/shm")
        f["shm_bytes"] = st.f_blocks * st.f_frsize
    except OSError:
        f["shm_bytes"] = None
    home = os.path.expanduser("~")
    f["env_file"] = bool(plan.get("env_file")) and os.path.isfile(os.path.join(home, plan["env_file"]))
    wd = plan.get("workdir")
    where = wd if wd and os.path.isdir(wd) else home
    st = os.statvfs(where)
    f["disk_free"] = {"path": where, "bytes": st.f_bavail * st.f_frsize}
    if wd:
        f["workdir"] = {"exists": os.path.isdir(wd)}
        manifest = plan.get("manifest")
        if manifest and os.path.isdir(wd):
            # rsync mode: compare with the controller's source; outputs on the node do not count.
            ns: dict[str, Any] = {}
            exec(compile(manifest["code"], "nodeops-manifest", "exec"), ns)
            f["workdir"]["manifest"] = ns["compare"](wd, manifest["manifest"])
            f["workdir"]["manifest"]["summary"] = ns["summary"](f["workdir"]["manifest"])
        elif os.path.isdir(wd) and not plan.get("fast"):
            f["workdir"].update(tree_hash(wd, plan.get("exclude", [])))
    if plan.get("script"):
        path = os.path.join(wd or home, os.path.expanduser(plan["script"]))
        f["script"] = {"path": path, "exists": os.path.isfile(path)}
    chief = resolve(plan["chief_address"])  # once: a DNS name is looked up here, as the ranks will
    f["route"] = route_to(chief, subnet=not plan.get("fast"))  # launch's fast preflight needs no subnet
    f["neigh"] = neighbour_limit(chief)
    f["ports"] = {str(p): connect(plan["chief_address"], p, plan["nonce"], plan["name"]) for p in plan["ports"]}
    if not plan.get("fast"):
        rc, out, err = _run(["nvidia-smi", f"--query-gpu={NVIDIA_QUERY}", "--format=csv,noheader,nounits"], 30)
        f["nvidia_smi"] = {"rc": rc, "gpus": parse_nvidia_smi(out) if rc == 0 else [],
                           "error": "" if rc == 0 else (err.strip() or out.strip()).splitlines()[-1:]}  # fmt: skip
    f["env"] = env_facts(plan)
    return f


class Listener:
    """Accepts probe connects on one port, answers with the nonce and this host's clock."""

    def __init__(self, port: int, nonce: str) -> None:
        self.port, self.nonce, self.error = port, nonce, ""
        self.seen: list[str] = []
        self.sock: socket.socket | None = None
        try:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("", port))
            s.listen(128)
            self.sock = s
            threading.Thread(target=self._serve, daemon=True).start()
        except OSError as e:
            self.error = f"cannot listen on port {port}: {e.strerror or e} (another job or service holds it?)"

    def _serve(self) -> None:
        assert self.sock is not None
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(5)
            try:
                data = conn.recv(512).decode(errors="replace").split()
                if len(data) == 3 and data[0] == "nodeops-check" and data[1] == self.nonce:
                    conn.sendall(f"{self.nonce} {time.time():.6f}\n".encode())
                    self.seen.append(data[2])
                    conn.recv(1)  # let the client close first: TIME_WAIT stays off the job's port
            except OSError:
                pass

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()


def probe_node(node: dict[str, Any], payload: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Pipe this probe to one node over ssh from the chief (BatchMode, strict host keys)."""
    argv = ["ssh", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes", "-o", "ConnectTimeout=5",
            "-p", str(node["port"])]  # fmt: skip
    if node.get("user"):
        argv += ["-l", node["user"]]
    argv += [node["address"], "python3 -c " + shlex.quote(BOOT)]
    t0 = time.monotonic()
    rc, out, err = _run(argv, timeout, json.dumps(payload))
    took = round(time.monotonic() - t0, 2)
    docs = documents(out)
    if docs:
        return {"ssh": {"ok": True, "seconds": took}, "facts": docs[0]}
    lines = [ln for ln in err.strip().splitlines() if ln.strip() and not ln.startswith("Warning: Permanently")]
    why = lines[-1] if lines else f"ssh exited {rc}"
    if rc == 255 or rc == 124:
        return {"ssh": {"ok": False, "error": why, "seconds": took}}
    return {"ssh": {"ok": True, "seconds": took}, "error": f"probe failed (exit {rc}): {why}"}


def chief_main(d: dict[str, Any]) -> dict[str, Any]:
    plan = d["plan"]
    listeners = [Listener(p, plan["nonce"]) for p in plan["ports"]]
    results: dict[str, object] = {}

    def one(node: dict[str, Any]) -> None:
        node_plan = dict(node["plan"], mode="node", name=node["name"], nonce=plan["nonce"], ports=plan["ports"],
                         chief_address=plan["chief_address"], manifest=plan.get("manifest"))  # fmt: skip
        results[node["name"]] = probe_node(node, {"source": d["source"], "plan": node_plan},
                                           plan.get("timeout", 120))  # fmt: skip

    # Bounded: the chief holds one ssh process (and its fds) per node in flight.
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(FANOUT, max(1, len(plan["nodes"])))) as pool:
        list(pool.map(one, plan["nodes"]))
    for lst in listeners:
        lst.close()
    return {
        "chief": {"hostname": socket.gethostname(), "python": sys.version.split()[0]},
        "listeners": {str(lst.port): {"error": lst.error, "seen": sorted(lst.seen)} for lst in listeners},
        "nodes": results,
    }


def main(d: dict[str, Any]) -> None:
    plan = d["plan"]
    out = chief_main(d) if plan["mode"] == "chief" else node_facts(plan)
    sys.stdout.write(frames(out))
    sys.stdout.flush()


def frames(doc: dict[str, Any]) -> str:
    """``doc`` as lines ``MARK <id> <i>/<n> <piece>``, each under :data:`FRAME` bytes + a header."""
    text = json.dumps(doc)  # ASCII (ensure_ascii), so a slice by characters is one by bytes
    tag = os.urandom(6).hex()
    pieces = [text[i : i + FRAME] for i in range(0, len(text), FRAME)] or [""]
    return "".join(f"{MARK}{tag} {i}/{len(pieces)} {p}\n" for i, p in enumerate(pieces))


def documents(output: str) -> list[dict[str, Any]]:
    """Every whole document in ``output`` (written by :func:`frames`, possibly interleaved with
    other lines and other documents' frames), in the order their last frame came."""
    parts: dict[str, dict[int, str]] = {}
    finished: set[str] = set()
    done: list[dict[str, Any]] = []
    for line in output.splitlines():
        if not line.startswith(MARK):
            continue
        tag, _, rest = line[len(MARK) :].partition(" ")
        count, _, piece = rest.partition(" ")
        i, _, n = count.partition("/")
        if not (i.isdigit() and n.isdigit()) or int(i) >= int(n) or tag in finished:
            continue  # not a frame, or one of a document already read (srun may repeat output)
        got = parts.setdefault(tag, {})
        got[int(i)] = piece
        if len(got) == int(n):
            finished.add(tag)
            try:
                doc = json.loads("".join(got.pop(k) for k in range(int(n))))
            except ValueError:
                continue  # garbled: that node counts as not having answered
            if isinstance(doc, dict):
                done.append(doc)
    return done
