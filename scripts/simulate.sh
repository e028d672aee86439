#!/usr/bin/env bash
# Sets everything up (idempotent), then runs the main job on the embedded default storage.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/hicache-async simulate "$@"
