"""The pure parts of setup's no-op path: the workdir manifest (with the real rsync), the
per-host marked blocks of ssh_mesh, --limit resolution and --diff rendering."""

from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
from pathlib import Path
from types import ModuleType

import pytest

from nodeops.errors import UsageError
from nodeops.lifecycle.setup import resolve_limit
from nodeops.resources import collections_path
from nodeops.setup import runner, workdir

ROOT = Path(__file__).resolve().parents[3]


def load(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def collection_module(name: str) -> ModuleType:
    """A module of the nodeops.cluster collection, imported as Ansible imports it (its
    module_utils come from the collection)."""
    import sys
    import tempfile

    base = Path(tempfile.gettempdir()) / f"nodeops-test-collections-{os.getuid()}"
    path = str(collections_path(base))
    if path not in sys.path:
        sys.path.insert(0, path)
    return importlib.import_module(f"ansible_collections.nodeops.cluster.plugins.modules.{name}")


blocks = collection_module("ssh_mesh_blocks")
manifest = workdir.manifest_module()
needs_rsync = pytest.mark.skipif(shutil.which("rsync") is None, reason="rsync is a setup dependency")


# --------------------------------------------------------------------------- manifest
def tree(root: Path) -> Path:
    (root / "src" / "pkg").mkdir(parents=True)
    (root / "src" / "pkg" / "m.py").write_text("x = 1\n")
    (root / "train.py").write_text("print(1)\n")
    (root / "sp ace.txt").write_text("s\n")
    (root / "nl\nname").write_text("n\n")
    (root / ".git").mkdir()
    (root / ".git" / "HEAD").write_text("ref\n")
    (root / "__pycache__").mkdir()
    (root / "__pycache__" / "x.pyc").write_bytes(b"\0")
    (root / "link").symlink_to("train.py")
    return root


@needs_rsync
def test_manifest_lists_what_rsync_copies_and_hashes_it(tmp_path: Path) -> None:
    src = tree(tmp_path / "src")
    m = manifest.build(str(src), [".git", "__pycache__"])
    assert sorted(m["files"]) == ["link", "nl\nname", "sp ace.txt", "src/pkg/m.py", "train.py"]
    assert m["files"]["link"] == ["link", "train.py"]
    assert m["files"]["train.py"][0] == 9 and len(m["files"]["train.py"][1]) == 64
    # the dry run's destination (inside the source) is never created
    assert not [n for n in os.listdir(src) if n.startswith(".nodeops-manifest")]


@needs_rsync
def test_anchored_and_glob_excludes_follow_rsync(tmp_path: Path) -> None:
    src = tree(tmp_path / "src")
    (src / "src" / "train.py").write_text("nested\n")
    m = manifest.build(str(src), ["/train.py", "*.txt", "pkg/"])
    # anchored /train.py drops only the top one; *.txt any .txt; pkg/ the directory and its files
    assert sorted(m["files"]) == [".git/HEAD", "__pycache__/x.pyc", "link", "nl\nname", "src/train.py"]


@needs_rsync
def test_node_compare_ignores_outputs_and_names_differences(tmp_path: Path) -> None:
    src = tree(tmp_path / "src")
    m = manifest.build(str(src), [".git", "__pycache__"])
    node = tmp_path / "node"
    shutil.copytree(src, node, symlinks=True)
    (node / "checkpoints").mkdir()
    (node / "checkpoints" / "model.pt").write_bytes(b"w" * 100)
    (node / "train.log").write_text("loss\n")
    r = manifest.compare(str(node), m)
    assert r["same"] and r["extra"] == 2 and sorted(r["extra_sample"]) == ["checkpoints/model.pt", "train.log"]
    assert "only here (outputs, kept)" in manifest.summary(r)
    (node / "train.py").write_text("print(2)\n")  # same size, other content
    (node / "src" / "pkg" / "m.py").unlink()
    (node / "link").unlink()
    (node / "link").symlink_to("elsewhere")
    r = manifest.compare(str(node), m)
    assert not r["same"] and (r["differ"], r["missing"]) == (2, 1)
    assert r["differ_sample"] == ["link", "train.py"] and r["missing_sample"] == ["src/pkg/m.py"]
    assert manifest.compare(str(tmp_path / "absent"), m)["missing"] == 5


# --------------------------------------------------------------------------- ssh_mesh_blocks
HOSTS = ["node1", "node2", "node3"]
USER = "# my own\nssh-ed25519 AAAAuser me@laptop\n"


def test_block_is_appended_and_user_lines_kept() -> None:
    out = blocks.updated(USER, "c", HOSTS, {"node1": ["ssh-ed25519 AAA1"]})
    assert out == USER + "# BEGIN nodeops ssh_mesh c\nssh-ed25519 AAA1 nodeops-c@node1\n# END nodeops ssh_mesh c\n"
    assert blocks.updated(out, "c", HOSTS, {"node1": ["ssh-ed25519 AAA1"]}) == out  # idempotent


def test_limited_run_keeps_lines_of_hosts_it_did_not_reach() -> None:
    full = blocks.updated(USER, "c", HOSTS, {h: [f"{h} ssh-ed25519 K{h}"] for h in HOSTS}) + "tail line\n"
    limited = blocks.updated(
        full, "c", HOSTS, {"node1": ["node1 ssh-ed25519 Knode1"], "node3": ["node3 ssh-ed25519 NEW"]}
    )
    assert "node2 ssh-ed25519 Knode2 nodeops-c@node2" in limited
    assert "node3 ssh-ed25519 NEW nodeops-c@node3" in limited and "Knode3" not in limited
    assert limited.startswith(USER) and limited.endswith("# END nodeops ssh_mesh c\ntail line\n")


def test_hosts_gone_from_the_inventory_are_dropped_and_empty_blocks_removed() -> None:
    full = blocks.updated(USER, "c", HOSTS, {h: [f"k{h}"] for h in HOSTS})
    fewer = blocks.updated(full, "c", ["node1", "node2"], {"node1": ["knode1"]})
    assert "knode3" not in fewer and "knode2 nodeops-c@node2" in fewer
    assert blocks.updated(full, "c", HOSTS, {h: [] for h in HOSTS}) == USER


def test_untagged_known_hosts_lines_from_older_runs_are_attributed_by_name() -> None:
    old = ("# BEGIN nodeops ssh_mesh c\n10.0.0.2,node2,n2 ssh-ed25519 OLD2\n"
           "[10.0.0.3]:2222,[node3]:2222 ssh-rsa OLD3\n# END nodeops ssh_mesh c\n")  # fmt: skip
    out = blocks.updated(old, "c", HOSTS, {"node1": ["10.0.0.1,node1 ssh-ed25519 K1"]})
    assert "10.0.0.2,node2,n2 ssh-ed25519 OLD2\n" in out and "[node3]:2222 ssh-rsa OLD3\n" in out


def test_known_hosts_lines_name_address_name_and_hostname_with_port() -> None:
    facts = {"address": "10.0.0.3", "port": 2222, "hostname": "gpu3", "host_keys": ["ssh-ed25519 K", "ssh-rsa R"]}
    pattern = "[10.0.0.3]:2222,[node3]:2222,[gpu3]:2222"
    assert blocks.known_hosts_lines("node3", facts) == [f"{pattern} ssh-ed25519 K", f"{pattern} ssh-rsa R"]
    same = {"address": "n", "port": 22, "hostname": "n", "host_keys": ["k x"]}
    assert blocks.known_hosts_lines("n", same) == ["n k x"]


# --------------------------------------------------------------------------- setup's request
def test_limit_takes_names_and_addresses() -> None:
    by_name = {"node1": "10.0.0.1", "node2": "10.0.0.2"}
    assert resolve_limit(by_name, "10.0.0.2,node1,node2") == ["node2", "node1"]
    assert resolve_limit(by_name, None) is None
    with pytest.raises(UsageError) as e:
        resolve_limit(by_name, "node9,10.0.0.1")
    assert e.value.exit_code == 2
    assert str(e.value) == "--limit: node9 not in the spec; hosts: node1 (10.0.0.1), node2 (10.0.0.2)"


def test_diffs_render_as_unified_diffs_per_file() -> None:
    out = runner.unified_diffs("Write env", [{"before_header": "/h/env.sh", "after_header": "/h/env.sh",
                                              "before": "a\nb\n", "after": "a\nc\n"}])  # fmt: skip
    assert out == ["Write env:\n--- /h/env.sh (now)\n+++ /h/env.sh (wanted)\n@@ -1,2 +1,2 @@\n a\n-b\n+c\n"]
    assert runner.unified_diffs("t", {"before": "x", "after": "x"}) == []
    assert runner.unified_diffs("t", None) == []
