"""Pure parts of the sandbox: argument checks, the spec it writes, mirror discovery."""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path

import pytest

from nodeops.sandbox import cluster as sandbox
from nodeops.sandbox.cluster import SandboxError
from nodeops.spec.load import load_spec_text


def test_addresses_start_at_11() -> None:
    assert sandbox._check_args("x", 3, "10.9.8.0/24") == ["10.9.8.11", "10.9.8.12", "10.9.8.13"]


@pytest.mark.parametrize(
    ("name", "n", "subnet", "message"),
    [
        ("Bad Name", 1, "10.9.8.0/24", "sandbox name"),
        ("ok", 1, "10.9.8.0/33", "not a network"),
        ("ok", 1, "fd00::/64", "IPv4"),
        ("ok", 300, "10.9.8.0/24", "fits 1 to 244 nodes"),
        ("ok", 0, "10.9.8.0/24", "fits"),
    ],
)
def test_bad_arguments(name: str, n: int, subnet: str, message: str) -> None:
    with pytest.raises(sandbox.SandboxError, match=message):
        sandbox._check_args(name, n, subnet)


def test_spec_text_is_a_valid_autodist_spec(tmp_path: Path) -> None:
    nodes = [sandbox.NodeInfo(f"node{i}", f"c{i}", f"10.0.0.{10 + i}", "running") for i in (1, 2)]
    spec = load_spec_text(sandbox.spec_text("t", nodes, tmp_path)).spec
    assert spec.chief.address == "10.0.0.11"
    assert spec.group(spec.nodes[1]).known_hosts == str(tmp_path / "known_hosts")


def test_apt_mirror_from_deb822(tmp_path: Path) -> None:
    f = tmp_path / "debian.sources"
    f.write_text("Types: deb\n# comment\nURIs: http://mirror.example/debian\nSuites: bookworm\n")
    assert sandbox.apt_mirror(f) == "http://mirror.example/debian"


def test_image_tag_follows_the_recipe(monkeypatch: pytest.MonkeyPatch) -> None:
    """Changing what goes into the image changes its tag, so a stale cached image is never reused."""
    tag = sandbox.default_image()
    assert re.fullmatch(r"nodeops-sandbox-node:bookworm-[0-9a-f]{12}", tag)
    monkeypatch.setattr(sandbox, "PACKAGES", (*sandbox.PACKAGES, "rsync"))
    assert sandbox.default_image() != tag


def test_free_subnet_skips_every_overlap() -> None:
    used = [ipaddress.ip_network(n) for n in ("10.213.0.0/24", "10.213.1.0/25", "172.17.0.0/16", "10.213.2.0/23")]
    assert sandbox.free_subnet(used) == "10.213.4.0/24"
    assert sandbox.free_subnet([]) == "10.213.0.0/24"
    # a wide route (10.0.0.0/8) covers every candidate: a clear error, not Docker's "Pool overlaps"
    with pytest.raises(SandboxError, match="pass --subnet"):
        sandbox.free_subnet([ipaddress.ip_network("10.0.0.0/8")])


def test_shared_dirs_are_bound_read_only_at_their_path() -> None:
    args = sandbox.shared_mounts([(Path("/var/cache/env"), "/opt/shared/env")])
    assert args == ["--mount", "type=bind,source=/var/cache/env,target=/opt/shared/env,readonly"]


@pytest.mark.parametrize(
    ("src", "dest", "message"),
    [
        ("relative/env", "/opt/env", "absolute paths"),
        ("/srv/env", "opt/env", "absolute paths"),
        ("/srv/a,b", "/opt/env", "without ','"),
        ("/srv/env", "/home/debian", "not over /home/debian"),
        ("/srv/env", "/usr/", "not over /usr"),
    ],
)
def test_shared_dirs_refused(src: str, dest: str, message: str) -> None:
    with pytest.raises(SandboxError, match=message):
        sandbox.shared_mounts([(Path(src), dest)])


def neigh_dir(tmp_path: Path, limits: tuple[int, int, int]) -> Path:
    d = tmp_path / "neigh"
    d.mkdir(parents=True)
    for knob, v in zip(("gc_thresh1", "gc_thresh2", "gc_thresh3"), limits, strict=True):
        (d / knob).write_text(f"{v}\n")
    return d


def test_a_big_sandbox_gets_room_in_the_shared_neighbour_table(tmp_path: Path) -> None:
    d = neigh_dir(tmp_path, (128, 512, 1024))  # the kernel's defaults
    assert sandbox.neighbour_room(8, d) is None  # 56 entries: room enough
    assert sandbox.neighbour_room(64, d) == (1024, 64 * 63 + 512)
    said: list[str] = []
    sandbox.make_neighbour_room(64, said.append, d)
    assert [int((d / k).read_text()) for k in ("gc_thresh1", "gc_thresh2", "gc_thresh3")] == [1136, 4544, 9088]
    assert said and "from 1024 to 9088" in said[0]
    said.clear()
    sandbox.make_neighbour_room(64, said.append, d)  # enough now: nothing done, nothing said
    assert said == []
    sandbox.make_neighbour_room(16, said.append, neigh_dir(tmp_path / "x", (128, 512, 99999)))
    assert said == []  # never lowered


def test_without_the_right_to_raise_it_the_sandbox_says_what_will_fail_and_the_fix(tmp_path: Path) -> None:
    d = tmp_path / "neigh"  # the limit can be read, not raised (here: the other knobs are missing)
    d.mkdir()
    (d / "gc_thresh3").write_text("1024\n")
    said: list[str] = []
    sandbox.make_neighbour_room(64, said.append, d)
    assert len(said) == 1 and said[0].startswith("warning: 64 nodes")
    assert "No route to host" in said[0] and "sysctl -w net.ipv4.neigh.default.gc_thresh3=9088" in said[0]
    assert (d / "gc_thresh3").read_text() == "1024\n"
