#!/usr/bin/env bash
# The project's test command (README quick start, and what .ci/run calls):
# linters first (fast), then the test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
export PATH="$PWD/.venv/bin:$PATH"

# One command per line: under `set -e`, a failure on the left of `&&` would not stop the script.
echo "==> ruff";     ruff check src tests bench scripts
                     ruff format --check src tests bench scripts
echo "==> mypy";     mypy
echo "==> import-linter (layers)"; lint-imports --no-cache
echo "==> yamllint"; yamllint --strict .
echo "==> ansible-lint (production profile)"; ansible-lint -q
echo "==> ansible-test sanity (the collection, as Galaxy reviewers test it)"; bash scripts/sanity.sh
echo "==> docs (generated references current; mkdocs build --strict)"
python scripts/docs_gen.py --check
NO_MKDOCS_2_WARNING=1 mkdocs build --strict -q
echo "==> docker";   bash scripts/ensure-docker.sh   # integration tests run real sshd containers
# The unit tests (pytest-xdist, a file per worker: the tests of one file share run ids found by
# tag in /proc) run beside the integration tests, which run alone, in order: they share the Docker
# sandboxes and their timings assume the machine's cores (the first integration files set up
# their sandboxes, with no timing bounds, while the unit tests run). The unit run's output is
# printed when it ends. With other arguments than output flags (a -k, a path), or with
# NODEOPS_TEST_WORKERS=0, pytest runs once, as asked, in one process.
echo "==> pytest"
workers=${NODEOPS_TEST_WORKERS:-3}
for a in "$@"; do
  case "$a" in -q | -qq | -v | -vv | -ra | -rA | -x) ;; *) workers=0 ;; esac
done
if [ "$workers" -eq 0 ]; then exec pytest "$@"; fi
unit_log=$(mktemp /tmp/nodeops-unit.XXXXXX)
unit_pid=""
trap 'if [ -n "$unit_pid" ]; then kill "$unit_pid" 2>/dev/null; fi; rm -f "$unit_log"' EXIT
pytest -n "$workers" --dist loadfile "$@" tests/unit >"$unit_log" 2>&1 &
unit_pid=$!
integration_rc=0
pytest "$@" tests/integration || integration_rc=$?
unit_rc=0
wait "$unit_pid" || unit_rc=$?
unit_pid=""
echo "==> pytest tests/unit (ran beside the integration tests, on $workers workers)"
cat "$unit_log"
echo "==> pytest: integration exit $integration_rc, unit exit $unit_rc"
[ "$integration_rc" -eq 0 ] && [ "$unit_rc" -eq 0 ]
