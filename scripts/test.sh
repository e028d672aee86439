#!/usr/bin/env bash
# Sets everything up (idempotent), lints, then runs the whole test suite. Fails loudly on any
# failure: a lint finding, a failing or erroring test.
set -euo pipefail
cd "$(dirname "$0")/.."
started=$SECONDS
bash scripts/setup.sh
echo "set-up: $((SECONDS - started)) s"
# Pyflakes' rules (pyproject's [tool.ruff.lint]): a shadowed import in a CUDA-only test fails only
# on a GPU, which CI never has; the linter finds it here.
.venv/bin/ruff check .
# The Mooncake tests import the real client and start a real mooncake_master: they fail, never
# skip, when it is missing. Only the CUDA tests skip, on machines without a GPU. Two workers
# (pytest-xdist): the tests that start vLLM engines run in order on one, every other module beside
# them on the other (tests/conftest.py schedules them). The 25 slowest tests print before pytest's
# summary line, which stays last.
exec .venv/bin/python -m pytest -v -ra --durations=25 -n 2 --dist loadscope "$@"
