#!/usr/bin/env bash
# The checks only a CUDA machine can run, in one command of under five minutes, each step
# logged into OUTDIR: first the same copy code over the simulated device (the CPU result a
# device run starts from), then every CUDA test (a failing step never stops the others), the
# slot state machine with its KV, streams and events on the GPU, and `bench --only gpu-copies`
# (its figures in OUTDIR/gpu_copies.json). Exits 1 if any step failed. Without CUDA it says so
# in one line and exits 0.
#
#   scripts/gpu_check.sh OUTDIR
#
# On a bare device machine (torch, CUDA and cuda-bindings, none of our other dependencies):
# lay out .gpu/ with ../shared/gpu/prepare.sh (relative to the project root; adding `tqdm
# lazy_loader` if the machine lacks them), then run `bash .gpu/run.sh bash scripts/gpu_check.sh
# OUT` carrying .gpu.
set -u
out=${1:?usage: scripts/gpu_check.sh OUTDIR}
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
if [ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ]; then py=.venv/bin/python; fi

if ! "$py" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; then
    echo "gpu_check: no CUDA device here (torch.cuda.is_available() is false for $py); nothing run"
    exit 0
fi
mkdir -p "$out"
"$py" - >"$out/env.log" 2>&1 <<'ENV'
import importlib, platform, torch
print("python", platform.python_version(), "| torch", torch.__version__, "| CUDA", torch.version.cuda,
      "|", torch.cuda.get_device_name(0), "x", torch.cuda.device_count())
for name in ("cuda.bindings", "numpy", "anyio", "hypothesis", "tqdm", "lazy_loader", "hicache_async.app.bench"):
    try:
        module = importlib.import_module(name)
        print(name, getattr(module, "__version__", "ok"))
    except Exception as exc:
        print(name, "MISSING:", exc)
ENV
cat "$out/env.log"

failed=0
step() {     # step NAME SECONDS COMMAND...: run it under a time limit into OUTDIR/NAME.log
    local name=$1 limit=$2 started=$SECONDS rc=0
    shift 2
    timeout -k 10 "$limit" "$@" >"$out/$name.log" 2>&1 || rc=$?
    local verdict=ok
    if [ "$rc" -ne 0 ]; then
        failed=1
        verdict="FAILED (exit $rc$([ "$rc" -eq 124 ] && echo ", past ${limit} s"))"
    fi
    echo "gpu_check: $name $verdict in $((SECONDS - started)) s; log $out/$name.log"
    tail -n 25 "$out/$name.log" | sed 's/^/    /'
}

step sim_device_tests 90 "$py" -m pytest -q -ra -p no:cacheprovider tests/transfer/test_sim_device.py \
    tests/transfer/test_sim_stream_copies.py tests/transfer/test_sim_copier.py tests/transfer/test_stream_copies.py \
    tests/plugins/vllm/test_slot_interleavings.py -k "not test_slot_interleavings or simulated"
step cuda_tests 110 "$py" -m pytest -v -ra -p no:cacheprovider tests/transfer/test_cuda.py
step slot_interleavings_cuda 70 env HICACHE_TEST_DEVICE=cuda "$py" -m pytest -v -ra -p no:cacheprovider \
    tests/plugins/vllm/test_slot_interleavings.py
step bench_gpu_copies 90 "$py" -c 'import sys; from hicache_async.app.cli import main; sys.exit(main(sys.argv[1:]))' \
    bench --only gpu-copies --json "$out/gpu_copies.json"
exit "$failed"
