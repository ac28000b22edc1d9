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
# Four workers: the integration tests all on one (they share the sandboxes; tests/conftest.py
# groups them), the unit tests on the others meanwhile. NODEOPS_TEST_WORKERS=0 runs one process.
echo "==> pytest";   pytest -n "${NODEOPS_TEST_WORKERS:-4}" --dist loadgroup "$@"
