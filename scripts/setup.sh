#!/usr/bin/env bash
# Idempotent set-up: Debian libs for Mooncake, .venv, pinned CPU torch first, then the package.
set -euo pipefail
cd "$(dirname "$0")/.."

apt_need=()
for pkg in libibverbs1 librdmacm1 libnuma1; do
  dpkg -s "$pkg" >/dev/null 2>&1 || apt_need+=("$pkg")
done
if ((${#apt_need[@]})); then
  sudo_cmd=""; [[ $(id -u) -eq 0 ]] || sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  $sudo_cmd env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${apt_need[@]}" >/dev/null
fi

[[ -x .venv/bin/python ]] || python3 -m venv .venv
py=.venv/bin/python
stamp=.venv/.hicache-setup
want="$(sha256sum pyproject.toml | cut -c1-16)"
if [[ ! -f $stamp || $(cat "$stamp") != "$want" ]]; then
  # torch before anything else: an unpinned torch pulled by a dependency would fetch a CUDA build.
  $py -m pip install -q "torch==2.13.0"
  $py -m pip install -q -e ".[dev,mooncake,otlp,plot]"
  echo "$want" > "$stamp"
fi
