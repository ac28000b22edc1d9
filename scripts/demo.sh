#!/usr/bin/env bash
# Quick-start demo on a fresh Debian machine: install nodeops, start a local 3-node sandbox
# of sshd containers, validate and render its spec, and drive all nodes with real Ansible.
# The sandbox stays up for you to try things; remove it with `.venv/bin/nodeops sandbox down`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
bash scripts/ensure-docker.sh
export PATH="$PWD/.venv/bin:$PATH"

echo "==> nodeops sandbox up -n 3"
spec=$(nodeops sandbox up -n 3)
echo "==> nodeops validate $spec"
nodeops validate "$spec"
out=out/demo
echo "==> nodeops render $spec -o $out"
nodeops render "$spec" -o "$out"
echo "---- $out/hostfile"; cat "$out/hostfile"
echo "==> every node, through the rendered inventory (real Ansible over ssh, host keys pinned):"
ANSIBLE_STDOUT_CALLBACK=minimal ansible -i "$out/inventory.yml" all -b -m ansible.builtin.command -a "uname -n"
echo "==> ssh as a user would:"
ssh -F "$out/ssh_config" node2 'echo "hello from $(hostname), $(nproc) cpu(s)"'
echo "---- bad input is refused with file:line, field and fix (exit 2):"
nodeops validate tests/specs/multi.error.several-at-once.yaml || echo "(exit $?)"
echo
echo "The sandbox is still up: nodeops sandbox status / nodeops sandbox down (in .venv/bin)."
