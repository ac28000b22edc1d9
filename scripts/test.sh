#!/usr/bin/env bash
# The project's test command (README quick start, and what .ci/run calls):
# linters first (the fast ones; ansible-lint and ansible-test sanity run beside the tests), then
# the test suite. Extra arguments go to pytest.
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
workers=${NODEOPS_TEST_WORKERS:-3}
for a in "$@"; do
  case "$a" in -q | -qq | -v | -vv | -ra | -rA | -x) ;; *) workers=0 ;; esac
done
slow_lints='echo "==> ansible-lint (production profile)"; ansible-lint -q
echo "==> ansible-test sanity (the collection, as Galaxy reviewers test it)"; bash scripts/sanity.sh'
if [ "$workers" -eq 0 ]; then
  bash -euo pipefail -c "$slow_lints"
  echo "==> pytest"
  exec pytest "$@"
fi
# The plain run: the two slow linters (about 3 minutes on a clean clone) also run beside the
# integration tests, in the background, and print their output when they end.
echo "==> pytest (ansible-lint and ansible-test sanity run beside it; their output comes at the end)"
unit_log=$(mktemp /tmp/nodeops-unit.XXXXXX)
lint_log=$(mktemp /tmp/nodeops-lint.XXXXXX)
unit_pid=""
lint_pid=""
# The linters run at nice 19 (the integration tests' timings come first), in a process group of
# their own (setsid execs in place here, without job control: $! is that group): an interrupted
# run (Ctrl-C, a TERM) exits at once and its EXIT trap ends ansible-test's children too.
trap 'if [ -n "$unit_pid" ]; then kill "$unit_pid" 2>/dev/null; fi
if [ -n "$lint_pid" ]; then kill -- "-$lint_pid" 2>/dev/null; fi; rm -f "$unit_log" "$lint_log"' EXIT
trap 'exit 130' INT TERM HUP
pytest -n "$workers" --dist loadfile "$@" tests/unit >"$unit_log" 2>&1 &
unit_pid=$!
setsid nice -n 19 bash -euo pipefail -c "$slow_lints" >"$lint_log" 2>&1 &
lint_pid=$!
integration_rc=0
pytest "$@" tests/integration || integration_rc=$?
unit_rc=0
wait "$unit_pid" || unit_rc=$?
lint_rc=0
wait "$lint_pid" || lint_rc=$?
unit_pid=""
lint_pid=""
echo "==> pytest tests/unit (ran beside the integration tests, on $workers workers)"
cat "$unit_log"
echo "==> ansible-lint and ansible-test sanity (ran beside the integration tests)"
cat "$lint_log"
echo "==> pytest: integration exit $integration_rc, unit exit $unit_rc; slow linters exit $lint_rc"
[ "$integration_rc" -eq 0 ] && [ "$unit_rc" -eq 0 ] && [ "$lint_rc" -eq 0 ]
