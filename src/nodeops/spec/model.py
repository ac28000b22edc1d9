"""The resource spec's schema: AutoDist's format, accepted verbatim, plus optional nodeops
sections, as pydantic models with their own validators; :class:`LoadedSpec`, a validated spec
with the positions its errors are reported at. Loading (YAML with positions, every problem at
once, cross-field rules) is :mod:`nodeops.spec.load`."""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from nodeops.errors import SpecIssue
from nodeops.node.stacks import HANG_TIMEOUT_MIN
from nodeops.spec.yamlpos import Located

Port = Annotated[int, Field(ge=1, le=65535)]
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")
_HOSTNAME = re.compile(
    r"^(?=.{1,253}\Z)([A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9])?)(\.[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9])?)*\.?\Z"
)
_IFNAME = re.compile(r"^[A-Za-z0-9_.:@-]{1,15}\Z")
# Keys of an SSH group. If any of them sits directly under ``ssh:`` with a scalar value,
# the file uses AutoDist's old ungrouped form (<= 2019-11).
GROUP_KEYS = frozenset({"username", "key_file", "port", "python_venv", "shared_envs", "known_hosts"})
LEGACY_GROUP = "default"
DEFAULT_VENV = "~/.nodeops/venv"


def _err(message: str, fix: str) -> PydanticCustomError:
    return PydanticCustomError("nodeops", "{message}", {"message": message, "fix": fix})


def _env_name(name: str) -> str:
    if not ENV_NAME.match(name):
        raise _err(
            f"{name!r} is not a valid environment variable name",
            "use letters, digits and underscores, not starting with a digit (e.g. MY_VAR)",
        )
    return name


def _env_value(value: str) -> str:
    if "\n" in value or "\r" in value or "\0" in value:
        raise _err("the value contains a line break or NUL", "put the value on one line")
    return value


def _scalar_to_str(value: Any) -> Any:
    """YAML turns ``4`` into an int; env values are strings, so accept numbers as written."""
    if isinstance(value, bool):
        raise _err("the value is a YAML boolean", f"quote it: '{str(value).lower()}'")
    if isinstance(value, int | float):
        return str(value)
    return value


# Keys and values of env mappings validate one by one, so an error points at its own line.
EnvName = Annotated[str, AfterValidator(_env_name)]
EnvValue = Annotated[str, BeforeValidator(_scalar_to_str), AfterValidator(_env_value)]


# Paths and names that reach shells, ssh_config, rsync and fstab: a conservative character set
# that no renderer needs to quote (they still quote; this is the user-facing refusal, with a line).
_PATH_CHARS = re.compile(r"^[A-Za-z0-9_./+@,:=-]*\Z")
_USERNAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,31}\Z")
_JUMP_HOP = re.compile(
    r"^(?:ssh://)?(?:[A-Za-z_][A-Za-z0-9_.-]{0,31}@)?(?:[A-Za-z0-9_.-]+|\[[0-9A-Fa-f:.]+\])(?::\d{1,5})?\Z"
)
_NFS_OPTIONS = re.compile(r"^[A-Za-z0-9_.,=:+/@-]+\Z")
_COMMAND = re.compile(r"^[A-Za-z0-9_./+-]+\Z")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def _jump_hop_ok(hop: str) -> bool:
    m = _JUMP_HOP.match(hop)
    port = hop.rpartition(":")[2] if m and not hop.endswith("]") and ":" in hop.removeprefix("ssh://") else None
    return bool(m) and (port is None or 1 <= int(port) <= 65535)


def _odd_chars(value: str, allowed: re.Pattern[str]) -> str:
    """The characters of value that the pattern does not allow, for the message."""
    odd = sorted({c for c in value if not allowed.match(c)})
    return " ".join(repr(c) for c in odd)


def _check_path(value: str, what: str, *, absolute: bool = False, allow_home: bool = True) -> str:
    if absolute:
        ok = value.startswith("/") or (allow_home and (value == "~" or value.startswith("~/")))
        if not ok:
            hint = "an absolute path such as /srv/train" + (" or one under ~/" if allow_home else "")
            raise _err(f"{what} {value!r} is not absolute", f"use {hint}")
    rest = value[1:] if allow_home and (value == "~" or value.startswith("~/")) else value
    if value == "" or not _PATH_CHARS.match(rest):
        odd = _odd_chars(rest, re.compile(r"[A-Za-z0-9_./+@,:=-]"))
        raise _err(
            f"{what} {value!r} is empty or has characters a path here may not hold" + (f": {odd}" if odd else ""),
            "use letters, digits and _ . / + @ , : = - only"
            + (" (a leading ~/ means the home dir)" if allow_home else "")
            + "; no spaces, quotes, $, `, ;, &, |, <, >, *, ? or line breaks",
        )
    return value


def _check_host(value: str, what: str) -> str:
    """An IP address or a DNS name (no user@, no spaces, nothing a shell or ssh would read)."""
    v = value.strip()
    try:
        ipaddress.ip_address(v)
        return v
    except ValueError:
        pass
    if "@" in v:
        raise _err(f"{what} {v!r} contains a user name", "put the user in an ssh group's `username`")
    if _HOSTNAME.match(v) is None:
        raise _err(f"{what} {v!r} is neither an IP address nor a host name", "use e.g. 10.0.0.2 or node-1.example")
    return v


def _no_control(value: str, what: str) -> str:
    if _CONTROL.search(value):
        raise _err(f"{what} contains a line break, tab or other control character", "write it on one line")
    return value


def _shared_env_value(value: str) -> str:
    """AutoDist shared_envs: ``$NAME`` and ``${NAME}`` expand on the node; command substitution
    and the other ``${...}`` forms would run code or surprise, so they are refused."""
    if "$(" in value or "`" in value:
        raise _err(
            "command substitution ($(...) or backticks) is not run in shared_envs",
            "write the value literally, or compute it in a --script that calls $NODEOPS_RUNNER",
        )
    for m in re.finditer(r"\$\{", value):
        if not re.match(r"\$\{[A-Za-z_][A-Za-z0-9_]*\}", value[m.start() :]):
            raise _err(
                "only $NAME and ${NAME} expand in shared_envs; other ${...} forms are not supported",
                "use $NAME or ${NAME}, or set the value in a --script",
            )
    return value


def is_loopback(address: str) -> bool:
    if address.lower() in {"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"}:
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


SharedEnvValue = Annotated[EnvValue, AfterValidator(_shared_env_value)]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, defer_build=True)


# --------------------------------------------------------------------------- AutoDist part
class SSHGroup(_Model):
    """One named SSH group (AutoDist's ``ssh.<group>``); nodes refer to it by ``ssh_config``."""

    username: str | None = Field(None, description="Login user on the nodes (default: your local user).")
    key_file: str | None = Field(None, description="Private key on the controller for this group.")
    port: Port = Field(22, description="sshd port on the nodes.")
    python_venv: str | None = Field(
        None, description="AutoDist: a shell snippet that activates the Python env, e.g. 'source ~/venv/bin/activate'."
    )
    shared_envs: dict[EnvName, SharedEnvValue] = Field(
        default_factory=dict,
        description="AutoDist: env vars for every process on these nodes; $NAME and ${NAME} expand on the node "
        "(command substitution is refused).",
    )
    known_hosts: str | None = Field(
        None, description="nodeops: known_hosts file that pins these nodes' host keys (default: ~/.ssh/known_hosts)."
    )
    host_key_checking: Literal["yes", "accept-new"] = Field(
        "yes", description="nodeops: 'yes' refuses unknown host keys; 'accept-new' trusts a key on first use only."
    )
    proxy_jump: str | None = Field(None, description="nodeops: bastion for ssh -J, e.g. 'user@bastion:22'.")
    node_python: str = Field(
        "/usr/bin/python3",
        description="nodeops: the system Python Ansible runs on these nodes; 'auto' lets Ansible discover it "
        "(about a second slower per run).",
    )

    @field_validator("node_python")
    @classmethod
    def _node_python(cls, v: str) -> str:
        return v if v == "auto" else _check_path(v, "node_python", absolute=True, allow_home=False)

    @field_validator("key_file", "known_hosts")
    @classmethod
    def _paths(cls, v: str | None) -> str | None:
        return None if v is None else _check_path(v, "path")

    @field_validator("username")
    @classmethod
    def _username(cls, v: str | None) -> str | None:
        if v is not None and not _USERNAME.match(v):
            raise _err(
                f"username {v!r} is not a login name",
                "use letters, digits, '_', '.' and '-', starting with a letter or '_' (e.g. ubuntu)",
            )
        return v

    @field_validator("proxy_jump")
    @classmethod
    def _jump(cls, v: str | None) -> str | None:
        if v is not None and not all(_jump_hop_ok(hop) for hop in v.split(",")):
            raise _err(f"proxy_jump {v!r} is not [user@]host[:port] (comma-separated hops)",
                       "write e.g. ops@bastion.example:22, or bastion1,bastion2")  # fmt: skip
        if v is not None and v.lower() == "none":
            raise _err(f"proxy_jump {v!r} is ssh's keyword for no jump host, not a host",
                       "leave proxy_jump out for a direct connection")  # fmt: skip
        return v

    @field_validator("python_venv")
    @classmethod
    def _venv_snippet(cls, v: str | None) -> str | None:
        # A shell snippet by design (AutoDist): it runs as written, so it is one line.
        return None if v is None else _no_control(v, "python_venv")


class Node(_Model):
    """One machine. ``address`` must be reachable from every other node."""

    address: str = Field(description="IP or DNS name the other nodes use to reach this one.")
    gpus: list[Annotated[int, Field(ge=0)]] | Literal["auto"] = Field(
        default_factory=list,
        description="GPU ids to use; 'auto': the ones nvidia-smi lists on the node (`setup` discovers them; "
        "a node without NVIDIA GPUs runs 1 process).",
    )
    cpus: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list, description="AutoDist: CPU device ids.")
    chief: bool = Field(False, description="Rank-0 node (MASTER_ADDR). Exactly one when there are several nodes.")
    ssh_config: str | None = Field(None, description="Name of the ssh group this node uses.")
    network_bandwidth: float | None = Field(None, gt=0, description="AutoDist: Gbps hint; accepted, not used.")
    name: str | None = Field(None, description="nodeops: short host alias for inventory and ssh_config.")
    nproc: Annotated[int, Field(ge=1)] | None = Field(
        None, description="nodeops: processes on this node (default: launch.nproc_per_node, else len(gpus), else 1)."
    )
    socket_ifname: str | None = Field(None, description="nodeops: network interface override for this node.")
    spare: bool = Field(
        False,
        description="nodeops: a spare node: set up and checked like the others, it runs no rank until it replaces a "
        "failed node (needs launch.restarts; never the chief).",
    )

    @field_validator("address")
    @classmethod
    def _address(cls, v: str) -> str:
        return _check_host(v, "address")

    @field_validator("name")
    @classmethod
    def _name(cls, v: str | None) -> str | None:
        if v is not None and (_HOSTNAME.match(v) is None or "." in v):
            raise _err(f"name {v!r} is not a simple host alias", "use letters, digits, '-' and '_' only, e.g. node-1")
        return v

    @field_validator("gpus", "cpus")
    @classmethod
    def _unique_ids(cls, v: list[int] | str) -> list[int] | str:
        if isinstance(v, str):
            return v
        dup = sorted({x for x in v if v.count(x) > 1})
        if dup:
            raise _err(f"device ids {dup} are listed more than once", "list each device id once")
        return v

    @field_validator("socket_ifname")
    @classmethod
    def _ifname(cls, v: str | None) -> str | None:
        if v is not None and _IFNAME.match(v) is None:
            raise _err(f"{v!r} is not a network interface name", "use a name from `ip -br link`, e.g. eth0 or ens5")
        return v


# --------------------------------------------------------------------------- nodeops sections
class EnvVar(_Model):
    """A global env var. Plain ``NAME: value`` in YAML is shorthand for ``{value: ...}``."""

    value: str | None = Field(None, description="The value, written in the spec.")
    from_env: str | None = Field(None, description="Read the value from this variable on the controller at run time.")
    secret: bool = Field(False, description="Never shown, logged or put on a command line; stored 0600 on nodes.")

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, v: Any) -> Any:
        return v if isinstance(v, dict) else {"value": _scalar_to_str(v)}

    @field_validator("value")
    @classmethod
    def _value(cls, v: str | None) -> str | None:
        return None if v is None else _env_value(v)

    @field_validator("from_env")
    @classmethod
    def _from_env(cls, v: str | None) -> str | None:
        return None if v is None else _env_name(v)

    @model_validator(mode="after")
    def _one_source(self) -> EnvVar:
        if (self.value is None) == (self.from_env is None):
            raise _err("give exactly one of `value` and `from_env`", "e.g. {from_env: HF_TOKEN, secret: true}")
        return self


class PythonSpec(_Model):
    venv: str | None = Field(None, description=f"venv path on every node (default {DEFAULT_VENV} unless conda).")
    conda: str | None = Field(None, description="conda env name to create/update instead of a venv.")
    conda_base: str = Field(
        "~/miniconda3", description="conda install dir on the nodes (holds etc/profile.d/conda.sh)."
    )
    interpreter: str = Field("python3", description="Python used to create the venv.")
    packages: list[str] = Field(default_factory=list, description="pip requirement strings, e.g. 'torch==2.13.0'.")
    requirements: str | None = Field(None, description="requirements.txt on the controller (relative to the spec).")
    wheelhouse: str | None = Field(
        None, description="Controller dir of wheels, synced to the nodes and installed with --no-index."
    )
    installer: Literal["auto", "uv", "pip"] = Field(
        "auto",
        description="Who installs the packages on the nodes: 'auto', uv with a wheelhouse (installed beside the env "
        "from it: put uv's wheel there), pip without one (uv reads neither pip.conf nor PIP_* variables) or where uv "
        "fails; 'uv': always uv, and setup fails without it; 'pip'. The env's packages are the same either way.",
    )
    py_spy: bool | None = Field(
        None,
        description="py-spy in the env, for `nodeops stacks` and the hang watchdog (read a rank's stack without "
        "stopping it). Default: installed where it can be (from the wheelhouse when one is given), with a warning "
        "where it cannot (stacks then use the ranks' signal hook); true: setup fails without it; false: not installed.",
    )

    @field_validator("venv")
    @classmethod
    def _venv(cls, v: str | None) -> str | None:
        if v is not None and v.rstrip("/") in ("", "~"):
            raise _err(f"venv {v!r} would make the home dir (or /) itself the venv", "use a dir, e.g. ~/.venvs/train")
        return None if v is None else _check_path(v, "venv", absolute=True)

    @field_validator("interpreter")
    @classmethod
    def _interpreter(cls, v: str) -> str:
        if not _COMMAND.match(v):
            raise _err(f"interpreter {v!r} is not a command name or path", "use e.g. python3 or /usr/bin/python3.11")
        return v

    @field_validator("packages")
    @classmethod
    def _packages(cls, v: list[str]) -> list[str]:
        for p in v:
            _no_control(p, f"package {p!r}")
            if p.strip().startswith("-") or not p.strip():
                raise _err(
                    f"package {p!r} is empty or a pip option",
                    "list requirement strings only (e.g. torch==2.13.0); put pip options in `requirements:`",
                )
        return v

    @field_validator("conda")
    @classmethod
    def _conda(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"[A-Za-z0-9_.-]+", v):
            raise _err(f"conda env name {v!r} has odd characters", "use letters, digits, '.', '-' and '_'")
        return v

    @field_validator("conda_base")
    @classmethod
    def _conda_base(cls, v: str) -> str:
        return _check_path(v, "conda_base", absolute=True)

    @field_validator("requirements", "wheelhouse")
    @classmethod
    def _ctl_paths(cls, v: str | None) -> str | None:
        return None if v is None else _check_path(v, "path")

    @model_validator(mode="after")
    def _venv_or_conda(self) -> PythonSpec:
        if self.venv is not None and self.conda is not None:
            raise _err("both `venv` and `conda` are set", "keep one: a venv path or a conda env name")
        return self

    @property
    def venv_path(self) -> str | None:
        if self.conda is not None:
            return None
        return self.venv or DEFAULT_VENV


class NfsSpec(_Model):
    server: str = Field(description="NFS server host.")
    export: str = Field(description="Exported path on the server, e.g. /exports/train.")
    options: str = Field("defaults", description="Mount options.")

    @field_validator("export")
    @classmethod
    def _export(cls, v: str) -> str:
        return _check_path(v, "export", absolute=True, allow_home=False)

    @field_validator("server")
    @classmethod
    def _server(cls, v: str) -> str:
        return _check_host(v, "server")

    @field_validator("options")
    @classmethod
    def _options(cls, v: str) -> str:
        if not _NFS_OPTIONS.match(v):
            raise _err(f"mount options {v!r} hold spaces or characters fstab and mount do not take",
                       "write comma-separated options without spaces, e.g. rw,hard,nfsvers=4.1")  # fmt: skip
        return v


class WorkdirSpec(_Model):
    path: str = Field(description="The same absolute working directory on every node.")
    sync: Literal["rsync", "nfs", "none"] = Field("rsync", description="How the dir gets its content.")
    source: str | None = Field(None, description="rsync: controller dir to copy (default: the spec's directory).")
    exclude: list[str] = Field(
        default_factory=lambda: [".git", ".venv", "venv", "__pycache__", ".nodeops"],
        description="rsync: patterns not copied.",
    )
    nfs: NfsSpec | None = Field(None, description="nfs: what to mount at `path`.")

    @field_validator("path")
    @classmethod
    def _path(cls, v: str) -> str:
        return _check_path(v, "workdir path", absolute=True, allow_home=False)

    @field_validator("source")
    @classmethod
    def _source(cls, v: str | None) -> str | None:
        return None if v is None else _check_path(v, "source")

    @field_validator("exclude")
    @classmethod
    def _exclude(cls, v: list[str]) -> list[str]:
        for e in v:
            _no_control(e, f"exclude pattern {e!r}")
            if not e:
                raise _err("an exclude pattern is empty", "remove it")
        return v

    @model_validator(mode="after")
    def _nfs(self) -> WorkdirSpec:
        if self.sync == "nfs" and self.nfs is None:
            raise _err("sync is nfs but no `nfs:` is given", "add nfs: {server: HOST, export: /exports/dir}")
        if self.sync != "nfs" and self.nfs is not None:
            raise _err(f"`nfs:` is given but sync is {self.sync!r}", "set `sync: nfs` or remove `nfs:`")
        return self


class FabricSpec(_Model):
    """`nodeops check --fabric` thresholds."""

    min_busbw_gbps: Annotated[float, Field(gt=0)] | None = Field(
        None,
        description="Fail when the all-nodes all-reduce, or a node's best pair, is below this bus bandwidth (Gbit/s).",
    )
    max_pair_spread: Annotated[float, Field(gt=0, le=1)] = Field(
        0.7,
        description="Flag a node whose best pair is below this share of a healthy node's (upper quartile; 3+ nodes).",
    )


class NetworkSpec(_Model):
    socket_ifname: str = Field(
        "auto", description="NCCL/GLOO socket interface: 'auto' (detected per node) or a name for all nodes."
    )
    ib: Literal["auto", "off"] = Field("auto", description="InfiniBand: 'off' sets NCCL_IB_DISABLE=1.")
    nccl: dict[EnvName, EnvValue] = Field(
        default_factory=dict, description="Extra NCCL_* variables, e.g. NCCL_DEBUG: INFO."
    )
    fabric: FabricSpec = Field(default_factory=FabricSpec, description="nodeops: `check --fabric` thresholds.")

    @field_validator("socket_ifname")
    @classmethod
    def _ifname(cls, v: str) -> str:
        if v != "auto" and _IFNAME.match(v) is None:
            raise _err(f"{v!r} is not a network interface name", "use 'auto' or a name such as eth0")
        return v

    @field_validator("nccl")
    @classmethod
    def _nccl(cls, v: dict[str, str]) -> dict[str, str]:
        for k in v:
            if not re.fullmatch(r"NCCL_[A-Z0-9_]*", k):
                raise _err(f"{k} is not an NCCL_* variable (NCCL's are upper case)",
                           "put other variables under top-level `env:`")  # fmt: skip
        return v


class MeshSpec(_Model):
    mode: Literal["chief", "full"] = Field(
        "chief", description="'chief': the chief can ssh to every node; 'full': all pairs."
    )
    key_file: str | None = Field(
        None,
        description="Controller private key to install as the chief's mesh key. Default: the chief generates its own "
        "(private keys are never copied unless you set this).",
    )
    relay: bool = Field(
        True,
        description="setup sends the wheelhouse and the workdir's files to the chief once, and the chief passes them "
        "on to the other nodes over the mesh (rsync with its mesh key), so the controller's traffic does not grow with "
        "the cluster. false: the controller sends them to every node.",
    )

    @field_validator("key_file")
    @classmethod
    def _key(cls, v: str | None) -> str | None:
        return None if v is None else _check_path(v, "key_file")


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def duration_seconds(value: Any) -> float | None:
    """``90``, ``90s``, ``10m``, ``1h`` (also ``d``, ``w``) in seconds; None when it is not one."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value) if value >= 0 else None
    m = _DURATION.match(str(value))
    return float(m.group(1)) * _UNITS[m.group(2)] if m else None


def hang_timeout_problem(secs: float) -> str:
    """Why a hang timeout (seconds; 0 is off) cannot be used, or ''."""
    if 0 < secs < HANG_TIMEOUT_MIN:
        return (f"the smallest is {HANG_TIMEOUT_MIN:g}s (the watchdog looks once a second; a shorter one cannot tell "
                "a hang from a quiet step); leave it unset for the default (half the collective timeout); "
                "0 turns it off")  # fmt: skip
    return ""


class LaunchSpec(_Model):
    runner: Literal["torchrun", "mpirun", "deepspeed"] = Field("torchrun", description="How ranks are started.")
    master_port: Port = Field(29500, description="MASTER_PORT on the chief.")
    rendezvous: Literal["static", "c10d"] = Field("static", description="torchrun rendezvous backend.")
    rdzv_port: Port = Field(29400, description="c10d rendezvous port on the chief.")
    max_restarts: Annotated[int, Field(ge=0)] = Field(0, description="torchrun --max-restarts.")
    nproc_per_node: Annotated[int, Field(ge=1)] | None = Field(
        None, description="Processes per node for every node; 'auto' (default) means len(gpus), else 1."
    )
    hang_timeout: float | None = Field(
        None,
        description="The hard hang timeout: when no rank prints anything (or touches $NODEOPS_PROGRESS_FILE) for "
        "this long, every rank's stack is taken, the stuck ranks are named and the run stops as hung (exit 124). "
        "The clock starts at every node's first progress (start-up gets at least 5 min). Seconds, or 90s, 10m, 1h; "
        "at least 5s; 0 turns it off. Default: half the collective timeout (5m with NCCL, 15m with gloo), so it "
        "fires before PyTorch ends the job naming no rank. Stalls are reported within seconds whatever it is "
        "(the stall watch learns the run's pace). --hang-timeout overrides it.",
    )
    collective_timeout: float | None = Field(
        None,
        description="The collective timeout your script gives init_process_group(timeout=...), so nodeops can keep "
        "its own timeouts below it (launch --dry-run prints them in order). Default: PyTorch's, 10m for NCCL "
        "(a node lists GPUs), 30m for gloo. nodeops does not pass it to the script.",
    )

    restarts: Annotated[int, Field(ge=0)] = Field(
        0,
        description="Automatic recovery: after a failure, stop every rank, exclude the failed node, bring in a spare "
        "(or go on with fewer nodes, down to min_nodes) and relaunch the same command up to this many times "
        "(NODEOPS_RESTART_COUNT tells the script). 0: stop and report. Runner torchrun; on Slurm inside the job's "
        "allocation (slurm.spare_nodes).",
    )
    restart_on: Literal["infra", "any"] = Field(
        "infra",
        description="Which failures restart: 'infra' (a lost node, a hang, a rank killed by a signal, a peer's loss) "
        "or 'any' (the script's own errors too, an uncaught exception among them even when the rank then died "
        "of a signal).",
    )
    min_nodes: Annotated[int, Field(ge=1)] | None = Field(
        None,
        description="With no spare left, a restart may go on with fewer nodes, down to this many (default: every "
        "non-spare node, so no shrinking).",
    )
    restart_backoff: float = Field(
        3.0,
        description="Seconds to wait before the first restart, doubled for each later one (at most 60); 3s, 1m.",
    )
    flight_recorder: bool | None = Field(
        None,
        description="PyTorch's NCCL flight recorder: every rank gets a buffer of 2000 entries, "
        "TORCH_NCCL_DUMP_ON_TIMEOUT=1 and a dump file in the run dir, under the names its torch reads (TORCH_FR_* "
        "from torch 2.8; each unless env or network.nccl sets it), so a "
        "collective timeout leaves one dump per rank; a failed or hung run's dumps are copied into its record. "
        "Default: on when a node lists GPUs (gpus: [...] or auto); ssh backend.",
    )

    @field_validator("hang_timeout", "collective_timeout", mode="before")
    @classmethod
    def _timeouts(cls, v: Any, info: ValidationInfo) -> Any:
        if v is None:
            return None
        secs = duration_seconds(v)
        if secs is None:
            raise _err(f"{v!r} is not a duration", "write seconds or a number with a unit: 90, 90s, 10m, 1h")
        if info.field_name == "collective_timeout" and secs < 2 * HANG_TIMEOUT_MIN:
            raise _err(f"{v!r} is shorter than any collective timeout a training script sets",
                       "give what your script passes to init_process_group (its NCCL default is 10m)")  # fmt: skip
        problem = hang_timeout_problem(secs) if info.field_name == "hang_timeout" else ""
        if problem:
            raise _err(f"{v!r} is too short to mean a hang", problem)
        return secs  # hang_timeout 0: off (None: the default)

    @field_validator("restart_backoff", mode="before")
    @classmethod
    def _backoff(cls, v: Any) -> Any:
        secs = duration_seconds(v)
        if secs is None:
            raise _err(f"{v!r} is not a duration", "write seconds or a number with a unit: 3, 3s, 1m")
        return secs

    @field_validator("nproc_per_node", mode="before")
    @classmethod
    def _auto(cls, v: Any) -> Any:
        return None if v == "auto" else v

    @model_validator(mode="after")
    def _ports(self) -> LaunchSpec:
        if self.rendezvous == "c10d" and self.rdzv_port == self.master_port:
            raise _err("rdzv_port equals master_port", "use two different ports, e.g. 29400 and 29500")
        return self


# sbatch options nodeops writes itself (the batch script's logs, signal, shape and requeue logic
# depend on them): sbatch_extra may not set them.
SBATCH_OWNED = frozenset({
    "output", "error", "open-mode", "signal", "nodes", "ntasks", "ntasks-per-node", "parsable", "requeue",
    "no-requeue", "chdir", "wrap", "gpus", "gpus-per-node", "gres", "partition", "account", "qos", "time",
    "cpus-per-task", "mem", "constraint", "exclusive", "job-name", "export", "array", "wait", "comment",
    "clusters", "hold", "test-only", "mem-per-cpu", "mem-per-gpu", "gpus-per-task", "ntasks-per-gpu",
})  # fmt: skip
_SBATCH_NAME = re.compile(r"[a-z][a-z0-9-]{0,40}")
_SBATCH_VALUE = re.compile(r"[A-Za-z0-9_.,:=@%/+\[\]-]{1,200}")
_SLURM_TIME = re.compile(r"\d+(:\d{1,2}){0,2}|\d+-\d+(:\d{1,2}){0,2}")  # M, M:S, H:M:S, D-H, D-H:M, D-H:M:S
_SLURM_WORD = re.compile(r"[A-Za-z0-9_.,:@%+-]{1,100}")


def _slurm_word(value: str | None, what: str, example: str) -> str | None:
    if value is not None and not _SLURM_WORD.fullmatch(value):
        raise _err(f"{what} {value!r} has characters sbatch would split or a shell would read",
                   f"use letters, digits and _ . , : @ % + -, e.g. {example}")  # fmt: skip
    return value


class SlurmSignal(_Model):
    # Not TERM or INT: scancel sends TERM (a stop would look like the time limit and requeue),
    # and srun takes one INT as a request for its tasks' status.
    name: Literal["USR1", "USR2"] = Field(
        "USR1", description="Signal sent before the time limit; torchrun forwards it to every rank."
    )
    seconds: Annotated[int, Field(ge=1, le=65535)] = Field(
        120, description="How long before the time limit (Slurm may send it up to 60 s earlier)."
    )


class SlurmSpec(_Model):
    """nodeops on a Slurm cluster: what `sbatch` asks for; the launch is one srun step of torchrun."""

    login: str | None = Field(
        None,
        description="The login node: the name or address of a node under `nodes:` (reached with its ssh group). "
        "Without it, sbatch/squeue/scancel run on this machine.",
    )
    partition: str | None = Field(None, description="sbatch --partition.")
    account: str | None = Field(None, description="sbatch --account.")
    qos: str | None = Field(None, description="sbatch --qos.")
    time: str | None = Field(None, description="sbatch --time: MM, HH:MM:SS, D-HH or D-HH:MM:SS.")
    nodes: Annotated[int, Field(ge=1)] = Field(1, description="sbatch --nodes: how many nodes the job gets.")
    gpus_per_node: Annotated[int, Field(ge=1)] | None = Field(
        None, description="sbatch --gpus-per-node; torchrun starts one rank per GPU Slurm gives a node."
    )
    gpus: Annotated[int, Field(ge=1)] | None = Field(
        None, description="sbatch --gpus: a total, for nodes with uneven GPU counts (instead of gpus_per_node)."
    )
    cpus_per_task: Annotated[int, Field(ge=1)] | None = Field(
        None, description="sbatch --cpus-per-task (the torchrun task of a node: its ranks share them)."
    )
    mem: str | None = Field(None, description="sbatch --mem, per node, e.g. 64G.")
    constraint: str | None = Field(None, description="sbatch --constraint, e.g. a100.")
    exclusive: bool = Field(False, description="sbatch --exclusive.")
    signal: SlurmSignal | None = Field(
        None, description="Signal the job before its time limit: the batch shell forwards it to torchrun."
    )
    max_requeues: Annotated[int, Field(ge=0)] = Field(
        0, description="Requeue the job up to this many times after a failure or the time-limit signal."
    )
    spare_nodes: Annotated[int, Field(ge=0)] = Field(
        0,
        description="nodeops: with launch.restarts, the job asks for this many nodes more; they run no rank until "
        "a restart inside the allocation replaces a failed node with one (the batch node is never replaced).",
    )
    sbatch_extra: dict[str, str | int | bool] = Field(
        default_factory=dict, description="More sbatch options, e.g. {reservation: big, begin: now+60}."
    )

    @field_validator("login")
    @classmethod
    def _login(cls, v: str | None) -> str | None:
        return None if v is None else _check_host(v, "login")

    @field_validator("partition", "account", "qos", "constraint")
    @classmethod
    def _words(cls, v: str | None) -> str | None:
        return _slurm_word(v, "this value", "gpu")

    @field_validator("time")
    @classmethod
    def _time(cls, v: str | None) -> str | None:
        if v is not None and not _SLURM_TIME.fullmatch(v):
            raise _err(f"time {v!r} is not a Slurm time limit", "use minutes (30), HH:MM:SS (02:00:00) or D-HH:MM:SS")
        return v

    @field_validator("mem")
    @classmethod
    def _mem(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"\d+[KMGT]?", v):
            raise _err(f"mem {v!r} is not a Slurm memory size", "use a number with K, M, G or T, e.g. 64G")
        return v

    @field_validator("sbatch_extra")
    @classmethod
    def _extra(cls, v: dict[str, Any]) -> dict[str, Any]:
        for k, value in v.items():
            name = k.removeprefix("--")
            if not _SBATCH_NAME.fullmatch(name):
                raise _err(f"{k!r} is not an sbatch option name", "use the long name without value, e.g. reservation")
            # sbatch takes any unique prefix of an option (getopt_long): --sig is --signal
            owned = sorted(o for o in SBATCH_OWNED if o.startswith(name))
            if owned:
                raise _err(f"sbatch_extra may not set --{owned[0] if name in owned else name}"
                           + ("" if name in owned else f" (sbatch reads it as --{owned[0]})") + ": nodeops writes it",
                           "use the slurm section's own field, or leave it to nodeops")  # fmt: skip
            if not isinstance(value, bool) and not _SBATCH_VALUE.fullmatch(str(value)):
                raise _err(f"sbatch_extra {k}: {value!r} has spaces, quotes or other characters sbatch would split",
                           "use a value without spaces or quotes")  # fmt: skip
        return v

    @model_validator(mode="after")
    def _gpus(self) -> SlurmSpec:
        if self.gpus is not None and self.gpus_per_node is not None:
            raise _err("both gpus and gpus_per_node are given", "keep one: gpus_per_node, or gpus as a total")
        if self.gpus is not None and self.gpus < self.nodes:
            raise _err(f"gpus {self.gpus} is fewer than nodes {self.nodes}", "give at least one GPU per node")
        return self


class ResourceSpec(_Model):
    """A cluster: AutoDist's ``nodes`` and ``ssh`` plus optional nodeops sections."""

    name: str | None = Field(None, description="nodeops: cluster name (default: the spec file's name).")
    nodes: list[Node] = Field(min_length=1, description="The machines; the chief is node rank 0.")
    ssh: dict[str, SSHGroup] = Field(default_factory=dict, description="Named ssh groups (AutoDist).")
    env: dict[EnvName, EnvVar] = Field(default_factory=dict, description="nodeops: env for every rank on every node.")
    python: PythonSpec | None = Field(None, description="nodeops: the Python env to build on every node.")
    workdir: WorkdirSpec | None = Field(None, description="nodeops: the shared working directory.")
    network: NetworkSpec = Field(default_factory=NetworkSpec, description="nodeops: NCCL/GLOO settings.")
    mesh: MeshSpec = Field(default_factory=MeshSpec, description="nodeops: passwordless ssh between the nodes.")
    launch: LaunchSpec = Field(default_factory=LaunchSpec, description="nodeops: how training is started.")
    backend: Literal["ssh", "slurm"] | None = Field(
        None,
        description="nodeops: 'ssh' (start ranks on `nodes:` over ssh) or 'slurm' (default: slurm when a "
        "`slurm:` section is given, else ssh).",
    )
    slurm: SlurmSpec | None = Field(None, description="nodeops: submit through Slurm (sbatch/srun).")

    @property
    def on_slurm(self) -> bool:
        return self.backend == "slurm" or (self.backend is None and self.slurm is not None)

    def login_node(self) -> Node | None:
        """The Slurm login node (from slurm.login), or None where sbatch runs on this machine."""
        if self.slurm is None or self.slurm.login is None:
            return None
        return next(n for n in self.nodes if self.slurm.login in (n.name, n.address))

    @field_validator("name")
    @classmethod
    def _cluster_name(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}", v):
            raise _err(f"cluster name {v!r} has odd characters", "use letters, digits, '.', '-' and '_'")
        return v

    # ---- derived views used by render/launch (pure, no I/O)
    @property
    def chief(self) -> Node:
        return next((n for n in self.nodes if n.chief), self.nodes[0])

    def ranked_nodes(self) -> list[Node]:
        """Nodes in node-rank order: the chief first, then the others in spec order (spares too:
        setup and check treat them as any node)."""
        chief = self.chief
        return [chief] + [n for n in self.nodes if n is not chief]

    def job_nodes(self) -> list[Node]:
        """The nodes a launch's first attempt runs on, in node-rank order: every node but the spares."""
        return [n for n in self.ranked_nodes() if not n.spare]

    def spares(self) -> list[Node]:
        return [n for n in self.ranked_nodes() if n.spare]

    def min_nodes(self) -> int:
        """How few nodes a recovered run may go on with (launch.min_nodes, else every non-spare node:
        on Slurm, slurm.nodes)."""
        if self.on_slurm and self.slurm is not None:
            return self.launch.min_nodes or self.slurm.nodes
        return self.launch.min_nodes or len(self.job_nodes())

    def group_name(self, node: Node) -> str | None:
        if node.ssh_config is not None:
            return node.ssh_config
        if len(self.ssh) == 1:
            return next(iter(self.ssh))
        return None

    def group(self, node: Node) -> SSHGroup:
        name = self.group_name(node)
        return self.ssh[name] if name is not None else SSHGroup()

    def nproc(self, node: Node) -> int:
        if node.nproc is not None:
            return node.nproc
        if self.launch.nproc_per_node is not None:
            return self.launch.nproc_per_node
        return (len(node.gpus) if isinstance(node.gpus, list) else 0) or 1  # gpus: auto before discovery: 1

    def alias(self, node: Node) -> str:
        return node.name or node.address

    def flight_recorder(self) -> bool:
        """launch.flight_recorder, else on when any node lists GPUs (NCCL runs)."""
        if self.launch.flight_recorder is not None:
            return self.launch.flight_recorder
        return any(n.gpus == "auto" or bool(n.gpus) for n in self.nodes)


# --------------------------------------------------------------------------- a loaded spec
@dataclass
class LoadedSpec:
    spec: ResourceSpec
    file: str
    warnings: list[SpecIssue] = field(default_factory=list)
    located: Located | None = field(default=None, repr=False)  # positions, for errors found after loading
    legacy: bool = False
    # gpus: auto, once resolved (nodeops.setup.gpus): each such node's GPU ids as setup discovered them
    discovered_gpus: dict[str, list[int]] | None = None

    def issue(self, path: tuple[str | int, ...], message: str, fix: str) -> SpecIssue:
        """An error at a field of the loaded file (``path`` as in the model), with its line."""
        if self.legacy and path[:2] == ("ssh", LEGACY_GROUP):
            path = ("ssh", *path[2:])
        if self.located is None:
            return SpecIssue(self.file, 1, 1, ".".join(str(p) for p in path), message, fix)
        return issue_at(self.located, path, message, fix, ".".join(str(p) for p in path))

    @property
    def spec_dir(self) -> Path:
        return Path(self.file).resolve().parent

    @property
    def cluster_name(self) -> str:
        return self.spec.name or re.sub(r"[^A-Za-z0-9_.-]", "-", Path(self.file).stem) or "cluster"


def _field_str(loc: tuple[str | int, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "<top>"


def issue_at(located: Located, loc: tuple[str | int, ...], message: str, fix: str, name: str = "",
              severity: Literal["error", "warning"] = "error") -> SpecIssue:  # fmt: skip
    """An issue at a path: file, line and field name as the data's source knows them (a spec
    file, or for an Ansible inventory the file and variable each value came from)."""
    file, pos, label = located.where(loc)
    return SpecIssue(file, pos.line, pos.col, label or name or _field_str(loc), message, fix, severity)


def controller_path(path: str, spec_dir: Path) -> str:
    """Controller-side paths in the spec are relative to the spec file; ``~`` stays for ssh/ansible to expand."""
    if path.startswith(("/", "~")):
        return path
    return str(spec_dir / path)


def json_schema() -> dict[str, Any]:
    schema = ResourceSpec.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "nodeops resource spec"
    return schema
