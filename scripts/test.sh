#!/usr/bin/env bash
# Sets everything up (idempotent), then runs the whole test suite. Fails loudly on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The Mooncake tests import the real client and start a real mooncake_master: they fail, never
# skip, when it is missing. Only the CUDA tests skip, on machines without a GPU.
exec .venv/bin/python -m pytest -v -ra "$@"
