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
# The integration tests run in two streams. The side stream holds modules with sandboxes of their
# own and no timing bounds (molecule's scenarios, the 16-node first setup), with a NODEOPS_HOME
# and a pytest basetemp of its own. The main stream runs its modules without timing bounds first
# (the shared sandbox's setup and check), then those marked `alone` (launch, stacks, recovery,
# Slurm, fabric), which wait until the side stream has ended (tests/integration/conftest.py).
side=(tests/integration/test_molecule.py tests/integration/test_scale.py)
main=(tests/integration/test_check.py tests/integration/test_collection.py tests/integration/test_install.py
      tests/integration/test_inventory.py tests/integration/test_sandbox.py tests/integration/test_setup.py
      tests/integration/test_fabric.py tests/integration/test_launch.py tests/integration/test_recovery.py
      tests/integration/test_slurm.py tests/integration/test_stacks.py)
listed=$(printf '%s\n' "${side[@]}" "${main[@]}" | sort)
found=$(printf '%s\n' tests/integration/test_*.py | sort)
if [ "$listed" != "$found" ]; then
  echo "scripts/test.sh: the integration modules it lists differ from tests/integration/test_*.py:" >&2
  diff <(echo "$listed") <(echo "$found") >&2 || true
  exit 2
fi
# (the node image first: both streams would build it at once on a machine without it)
python -c 'from nodeops.sandbox import cluster; cluster.ensure_engine(); cluster.ensure_image(None, "auto", print)'
scratch=$(mktemp -d /tmp/nodeops-test.XXXXXX)
unit_log=$scratch/unit.log
lint_log=$scratch/lint.log
side_log=$scratch/side.log
side_done=$scratch/side.rc
mkdir "$scratch/side-home"
unit_pid=""
lint_pid=""
side_pid=""
# The linters run at nice 19 (the integration tests' timings come first), in a process group of
# their own (setsid execs in place here, without job control: $! is that group): an interrupted
# run (Ctrl-C, a TERM) exits at once and its EXIT trap ends ansible-test's children too. The side
# stream is a group of its own too (its pytest, molecule and the setups they run).
trap 'if [ -n "$unit_pid" ]; then kill "$unit_pid" 2>/dev/null; fi
if [ -n "$lint_pid" ]; then kill -- "-$lint_pid" 2>/dev/null; fi
if [ -n "$side_pid" ]; then kill -- "-$side_pid" 2>/dev/null; fi; rm -rf "$scratch"' EXIT
trap 'exit 130' INT TERM HUP
pytest -n "$workers" --dist loadfile "$@" tests/unit >"$unit_log" 2>&1 &
unit_pid=$!
setsid nice -n 19 bash -euo pipefail -c "$slow_lints" >"$lint_log" 2>&1 &
lint_pid=$!
# shellcheck disable=SC2016  # (expanded by the inner bash: $1 scratch, $2 side_done, then pytest's)
NODEOPS_HOME=$scratch/side-home setsid bash -c 'rc=0; pytest --basetemp="$1/side-tmp" "${@:3}" || rc=$?
echo "$rc" >"$2.tmp"; mv "$2.tmp" "$2"' side "$scratch" "$side_done" "$@" "${side[@]}" >"$side_log" 2>&1 &
side_pid=$!
integration_rc=0
NODEOPS_TEST_ALONE_AFTER=$side_done pytest "$@" "${main[@]}" || integration_rc=$?
unit_rc=0
wait "$unit_pid" || unit_rc=$?
lint_rc=0
wait "$lint_pid" || lint_rc=$?
wait "$side_pid" || true
side_rc=$(cat "$side_done" 2>/dev/null || echo 1)
unit_pid=""
lint_pid=""
side_pid=""
echo "==> pytest ${side[*]} (the side stream, ran beside the first integration modules)"
cat "$side_log"
echo "==> pytest tests/unit (ran beside the integration tests, on $workers workers)"
cat "$unit_log"
echo "==> ansible-lint and ansible-test sanity (ran beside the integration tests)"
cat "$lint_log"
echo "==> pytest: integration exit $integration_rc (side stream $side_rc), unit exit $unit_rc; slow linters exit $lint_rc"
[ "$integration_rc" -eq 0 ] && [ "$side_rc" -eq 0 ] && [ "$unit_rc" -eq 0 ] && [ "$lint_rc" -eq 0 ]
