#!/usr/bin/env bash
# Sets everything up (idempotent), then runs the whole test suite. Fails loudly on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HICACHE_REQUIRE_MOONCAKE=1   # the Mooncake tests must run against a real master, never skip
exec .venv/bin/python -m pytest -ra "$@"
