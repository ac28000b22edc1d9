#!/usr/bin/env bash
# ansible-test sanity on the built nodeops.cluster collection: the suite Galaxy and Automation
# Hub reviewers run. Called by scripts/test.sh; extra arguments go to ansible-test
# (`bash scripts/sanity.sh --test validate-modules`).
#
# Offline after the first run: ansible-test builds one venv per sanity test (without pip), puts
# pip in it with a get-pip script it downloads from ci-files.testing.ansible.com, then installs
# its pinned requirements there. Here:
# - the pins (ansible_test/_data/requirements/sanity.*.txt) and ansible-test's pip are downloaded
#   once from the package index into .cache/sanity-wheels;
# - ansible-test runs with a HOME of its own (it passes HOME to pip, not PIP_*) whose pip.conf
#   says no-index + find-links to that folder;
# - in place of the get-pip download, the cache path ansible-test looks in first holds a small
#   script of ours: pip from the stdlib's ensurepip, then the pip version ansible-test asks for,
#   from the wheelhouse.
# Its venvs are kept under .cache/ansible-test-home, so later runs install nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
py=$root/.venv/bin/python
core=$("$py" -c 'import ansible.release as r; print(r.__version__)')
reqs=$("$py" -c 'import ansible_test, os; print(os.path.join(os.path.dirname(ansible_test.__file__), "_data", "requirements"))')
# the pip version ansible-test bootstraps into its venvs (not public API: a rename fails here, loudly)
pipv=$("$py" -c 'import sys, types; from ansible_test._internal.python_requirements import get_venv_packages as g
print(g(types.SimpleNamespace(version="%d.%d" % sys.version_info[:2]))["pip"])')
wheels=$root/.cache/sanity-wheels
home=$root/.cache/ansible-test-home

if [ ! -f "$wheels/.complete-$core" ]; then
  echo "==> downloading ansible-test $core's sanity requirements into $wheels (once)"
  args=()
  for f in "$reqs"/sanity.*.txt; do args+=(-r "$f"); done
  # pip, setuptools, wheel: what a fresh venv may upgrade to before installing
  "$py" -m pip download -q -d "$wheels" "${args[@]}" "pip==$pipv" setuptools wheel
  touch "$wheels/.complete-$core"
fi
mkdir -p "$home/.config/pip"
printf '[global]\nno-index = true\nfind-links = %s\n' "$wheels" > "$home/.config/pip/pip.conf"
mkdir -p "$home/.ansible/test/cache"
cat > "$home/.ansible/test/cache/get_pip_${pipv//./_}.py" <<'PY'
"""Stands in for ansible-test's downloaded get-pip script, offline (written by nodeops'
scripts/sanity.sh): pip from the stdlib's ensurepip, then what ansible-test asked for
(pip==VERSION) from the wheelhouse that pip.conf names."""
import subprocess
import sys

args = [a for a in sys.argv[1:] if a not in ("--no-setuptools", "--no-wheel")]
subprocess.check_call([sys.executable, "-m", "ensurepip", "--default-pip"], stdout=subprocess.DEVNULL)
subprocess.check_call([sys.executable, "-m", "pip", "install", "-q", *args])
PY

work=$(mktemp -d /tmp/nodeops-sanity.XXXXXX)
trap 'rm -rf "$work"' EXIT
"$root/.venv/bin/ansible-galaxy" collection build -v --output-path "$work" . >/dev/null
coll=$work/ansible_collections/nodeops/cluster
mkdir -p "$coll"
tar -xzf "$work"/nodeops-cluster-*.tar.gz -C "$coll"
# ansible-test works on a git-less tree when told which files are the collection's
cd "$coll"
echo "==> ansible-test sanity (ansible-core $core) on the built collection"
HOME=$home "$root/.venv/bin/ansible-test" sanity --python "$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])')" \
  --color no "$@"
