#!/usr/bin/env bash
# Create ./.venv with nodeops and its dev tools. Safe to re-run; does nothing that is already done.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v python3 >/dev/null || need_apt+=(python3)
python3 -c 'import venv, ensurepip' 2>/dev/null || need_apt+=(python3-venv)
command -v shellcheck >/dev/null || need_apt+=(shellcheck)  # ansible-test sanity's shellcheck test
if ((${#need_apt[@]})); then
  echo "==> installing ${need_apt[*]} (apt)"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

stamp=.venv/.nodeops-installed
if [ ! -x .venv/bin/python ]; then
  echo "==> creating .venv"
  python3 -m venv .venv
fi
# Reinstall only when the project's metadata changed since the last install.
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "==> installing nodeops and dev tools into .venv"
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e '.[dev]'
  touch "$stamp"
fi
