#!/usr/bin/env bash
# Quick-start demo: validate an example spec and render everything nodeops derives from it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
export PATH="$PWD/.venv/bin:$PATH"
out=out/demo
echo "==> nodeops validate examples/cluster.yaml"
nodeops validate examples/cluster.yaml
echo "==> nodeops render examples/cluster.yaml -o $out"
nodeops render examples/cluster.yaml -o "$out"
for f in hostfile .deepspeed_env ssh_config; do
  echo "---- $out/$f"; cat "$out/$f"
done
echo "---- bad input is refused with file:line, field and fix (exit 2):"
nodeops validate tests/specs/multi.error.several-at-once.yaml || echo "(exit $?)"
