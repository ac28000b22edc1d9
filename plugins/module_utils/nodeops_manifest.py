# SPDX-License-Identifier: Apache-2.0
# -*- coding: utf-8 -*-
"""The workdir manifest: what the controller's source holds, and how a node compares to it.

One file, stdlib only, used by every side that asks "does this node have the source?":
the shared_path role (its lookup on the controller, its module on the nodes), and nodeops'
``check`` / ``launch`` preflight (which ship this file to the nodes as source).

- :func:`build` runs on the controller. The file list comes from rsync itself (a dry run
  with the same ``--exclude`` options the role's copy uses), so the manifest honours
  exactly rsync's exclude semantics. Each entry is ``[size, sha256]`` for a file or
  ``["link", target]`` for a symlink.
- :func:`compare` runs on a node. Only the manifest's paths are read: files that exist
  only on the node (checkpoints, logs, caches a job wrote) never make it differ; they are
  counted, as information.
"""

from __future__ import absolute_import, division, print_function

import hashlib
import os
import re
import subprocess

VERSION = 1
SAMPLE = 10  # paths named in a report, per kind
_ESC = re.compile(rb"\\#([0-7]{3})")


def rsync_listing(source, exclude, rsync="rsync"):
    """Relative paths of the files and symlinks rsync would copy from ``source``."""
    src = source.rstrip("/") + "/"
    argv = [rsync, "-a", "-n", "-8", "--out-format=%n"] + ["--exclude=" + e for e in exclude]
    # A destination that does not exist: the dry run lists every entry and creates nothing.
    argv += [src, os.path.join(src, ".nodeops-manifest-nonexistent-" + hashlib.sha1(src.encode()).hexdigest()[:8])]
    p = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, check=False)
    if p.returncode != 0:
        raise OSError("rsync could not list %s: %s" % (source, p.stderr.decode("utf-8", "replace").strip()))
    out = []
    for raw in p.stdout.split(b"\n"):
        if not raw or raw.endswith(b"/"):
            continue  # directories: their files are listed
        out.append(os.fsdecode(_ESC.sub(lambda m: bytes([int(m.group(1), 8)]), raw)))
    return sorted(out)


def file_sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def entry(path):
    """The manifest entry of one path, or None when it is missing (or not a file or link)."""
    try:
        if os.path.islink(path):
            return ["link", os.readlink(path)]
        if not os.path.isfile(path):
            return None
        return [os.path.getsize(path), file_sha256(path)]
    except OSError:
        return None


def build(source, exclude, rsync="rsync"):
    """The manifest of a controller-side source directory."""
    files = {}
    for rel in rsync_listing(source, exclude, rsync):
        e = entry(os.path.join(source, rel))
        if e is not None:
            files[rel] = e
    digest = hashlib.sha256(repr(sorted(files.items())).encode("utf-8", "surrogateescape")).hexdigest()
    return {"version": VERSION, "source": source, "exclude": list(exclude), "files": files, "digest": digest[:16]}


def _same(path, want):
    if want[0] == "link":
        return os.path.islink(path) and os.readlink(path) == want[1]
    if os.path.islink(path) or not os.path.isfile(path):
        return False
    return os.path.getsize(path) == want[0] and file_sha256(path) == want[1]


def _count_extra(root, listed, exclude):
    """Files under root that the manifest does not list (outputs). Names in exclude are skipped."""
    names = {e.strip("/") for e in exclude if "/" not in e.strip("/") and not any(c in e for c in "*?[")}
    n, sample = 0, []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in names)
        rel_dir = os.path.relpath(dirpath, root)
        for name in sorted(filenames):
            if name in names:
                continue
            rel = name if rel_dir == "." else os.path.join(rel_dir, name)
            if rel not in listed:
                n += 1
                if len(sample) < SAMPLE:
                    sample.append(rel)
    return n, sample


def compare(root, manifest):
    """How the directory ``root`` on this machine differs from ``manifest``."""
    report = {"path": root, "source": manifest.get("source"), "exists": os.path.isdir(root), "digest": manifest.get("digest"),
              "files": len(manifest.get("files", {})), "missing": 0, "differ": 0, "extra": 0,
              "missing_sample": [], "differ_sample": [], "extra_sample": [], "same": False}  # fmt: skip
    if not report["exists"]:
        report["missing"] = report["files"]
        report["missing_sample"] = sorted(manifest.get("files", {}))[:SAMPLE]
        return report
    files = manifest.get("files", {})
    for rel in sorted(files):
        path = os.path.join(root, rel)
        try:
            if not os.path.lexists(path):
                kind = "missing"
            elif _same(path, files[rel]):
                continue
            else:
                kind = "differ"
        except OSError:
            kind = "differ"
        report[kind] += 1
        if len(report[kind + "_sample"]) < SAMPLE:
            report[kind + "_sample"].append(rel)
    report["extra"], report["extra_sample"] = _count_extra(root, files, manifest.get("exclude", []))
    report["same"] = report["missing"] == 0 and report["differ"] == 0
    return report


def summary(report):
    """One line: what differs, or that the node has the source (and how many outputs)."""
    if not report.get("exists"):
        return "%s does not exist" % report.get("path")
    parts = []
    for kind, verb in (("missing", "missing"), ("differ", "differ from the source")):
        if report.get(kind):
            parts.append("%d file(s) %s (%s%s)" % (report[kind], verb, ", ".join(report[kind + "_sample"][:3]),
                                                   ", ..." if report[kind] > 3 else ""))  # fmt: skip
    if not parts:
        line = "same as the source (%d file(s), manifest %s)" % (report.get("files", 0), report.get("digest"))
    else:
        line = "; ".join(parts)
    if report.get("extra"):
        line += "; %d file(s) only here (outputs, kept)" % report["extra"]
    return line
