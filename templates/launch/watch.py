"""nodeops launch: the chief's watcher (stdlib only). Started in its own session next to the job.

Reads watch.json ({"run_id", "pdsh", "hosts": [{"name", "address", "port", "user", "local",
"started"}]}), and for every host that started a job blocks on `wait.sh` over ssh from the chief
(BatchMode, strict host keys). When any host's job ends non-zero, or a host is lost (its ssh
dies after watching began), it runs `kill.sh` on every host at once, so a detached run fails
fast even with no controller left. With "pdsh" (DeepSpeed's runner) it also follows the chief's
host.log for pdsh's "ssh exited with exit code N" report of a failed node. Progress goes to
watch.log; the outcome to watch.result.
"""

import json
import os
import re
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(HERE, "watch.json")) as f:
    cfg = json.load(f)
RUN = ".nodeops/runs/" + cfg["run_id"]
lock = threading.Lock()
state = {"torn_down": False}


def log(msg):
    with lock:
        sys.stdout.write(f"{time.time():.3f} {msg}\n")
        sys.stdout.flush()


def remote(host, script):
    if host.get("local"):
        return ["bash", os.path.join(os.path.expanduser("~"), RUN, script)]
    # The long-lived wait.sh connection becomes a control master that kill.sh's ssh reuses, so the
    # teardown does not pay for new ssh handshakes on a loaded node.
    # (~/.ssh, not the run dir: a socket path must stay under 108 bytes.)
    opts = ["BatchMode=yes", "StrictHostKeyChecking=yes", "ConnectTimeout=10", "ServerAliveInterval=2"]
    opts += ["ServerAliveCountMax=3", "ControlMaster=auto", "ControlPath=~/.ssh/nodeops-w-%C", "ControlPersist=30"]
    argv = ["ssh", "-p", str(host["port"])]
    for o in opts:
        argv += ["-o", o]
    if host.get("user"):
        argv += ["-l", host["user"]]
    return [*argv, host["address"], f"bash {RUN}/{script}"]


def teardown(why, skip=""):
    """kill.sh on every host but `skip` (the host that failed: its job is ending by itself)."""
    with lock:
        if state["torn_down"]:
            return
        state["torn_down"] = True
    t0 = time.time()
    log("stopping every host: " + why)

    def kill(host):
        try:
            subprocess.run(remote(host, "kill.sh"), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=30)
        except subprocess.TimeoutExpired:
            log("kill.sh timed out on " + host["name"])

    threads = [threading.Thread(target=kill, args=(h,)) for h in cfg["hosts"] if h["name"] != skip]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    log(f"stopped every host in {time.time() - t0:.2f}s")


def watch(host):
    p = subprocess.Popen(
        remote(host, "wait.sh"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True
    )
    watching = False
    code = None
    for line in p.stdout:
        line = line.strip()
        if line == "watching":
            watching = True
        elif line:
            code = line
    rc = p.wait()
    err = p.stderr.read().strip().splitlines()
    why = err[-1] if err else f"ssh exited {rc}"
    if code is None:
        if not watching:
            log(f"cannot watch {host['name']}: {why}")
            return
        log(f"{host['name']} lost: {why}")
        teardown(host["name"] + " was lost")
        return
    log(f"{host['name']} ended: {code}")
    if code != "0":
        teardown(f"{host['name']} ended with {code}", skip=host["name"])


def follow_pdsh():
    """DeepSpeed's runner: pdsh reports a node whose command failed, then keeps waiting."""
    pattern = re.compile(r"^pdsh@\S+: (\S+): ssh exited with exit code (\d+)")
    log_path = os.path.join(HERE, "host.log")
    while not os.path.exists(log_path) and not os.path.exists(os.path.join(HERE, "exit_code")):
        time.sleep(0.2)
    with open(log_path, errors="replace") as f:
        while True:
            line = f.readline()
            if not line:
                if os.path.exists(os.path.join(HERE, "exit_code")) or state["torn_down"]:
                    return
                time.sleep(0.2)
                continue
            m = pattern.match(line)
            if m and m.group(2) != "0":
                teardown(f"pdsh: {m.group(1)} exited with {m.group(2)}")
                return


threads = [threading.Thread(target=watch, args=(h,)) for h in cfg["hosts"] if h.get("started", True)]
if cfg.get("pdsh"):
    threads.append(threading.Thread(target=follow_pdsh, daemon=True))
for t in threads:
    t.start()
for t in threads:
    if not t.daemon:
        t.join()
with open(os.path.join(HERE, "watch.result"), "w") as f:
    f.write("torn_down\n" if state["torn_down"] else "clean\n")
log("done")
