#!/usr/bin/env bash
# Quick-start demo on a fresh Debian machine: install nodeops, start a local 3-node sandbox of
# sshd containers, prepare it with `nodeops setup` (ssh mesh, a venv with torch from a local
# wheelhouse, the workdir, NCCL/Gloo env), then `nodeops launch` a small DDP training (gloo, CPU).
# The sandbox stays up for you to try things; remove it with `.venv/bin/nodeops sandbox down`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
bash scripts/ensure-docker.sh
export PATH="$PWD/.venv/bin:$PATH"

wheels=.cache/wheelhouse-torch
# the same list and marker as tests/integration/conftest.py (one wheelhouse serves both)
if [ ! -e "$wheels/.complete-3" ]; then
  echo "==> downloading torch 2.13.0 (CPU), numpy, py-spy and their dependencies into $wheels (once; the nodes have no internet)"
  python -m pip download -q torch==2.13.0 numpy py-spy -d "$wheels" && touch "$wheels/.complete-3"
fi

echo "==> nodeops sandbox up -n 3"
sandbox_spec=$(nodeops sandbox up -n 3)
demo=out/demo
mkdir -p "$demo/project"
cp examples/ddp_train.py "$demo/project/"
{ cat "$sandbox_spec"; cat <<YAML
python:
  packages: ["torch==2.13.0", numpy]
  wheelhouse: $PWD/$wheels
workdir:
  path: /srv/demo
  source: $PWD/$demo/project
network:
  ib: "off"
YAML
} > "$demo/cluster.yaml"
echo "==> nodeops validate $demo/cluster.yaml"
nodeops validate "$demo/cluster.yaml"
echo "==> nodeops setup $demo/cluster.yaml"
nodeops setup "$demo/cluster.yaml"
echo "==> nodeops check $demo/cluster.yaml"
nodeops check "$demo/cluster.yaml"
echo "==> nodeops launch $demo/cluster.yaml -- ddp_train.py --steps 10"
nodeops launch "$demo/cluster.yaml" -- ddp_train.py --steps 10
echo
echo "Every rank printed the same final param hash above. The sandbox is still up:"
echo "  .venv/bin/nodeops sandbox status / .venv/bin/nodeops sandbox down"
