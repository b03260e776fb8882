#!/usr/bin/env bash
# One pass on a GPU machine: build, `make test-gpu`, `make bench`, and a short `make run`, with every
# log under LOG_DIR (default build/gpu-all). Prints a short summary at the end.
#   scripts/gpu-all.sh [LOG_DIR]
set -u
LOG=${1:-build/gpu-all}
mkdir -p "$LOG"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 NCCL_NVLS_ENABLE=0
nvidia-smi -L > "$LOG/gpus.txt" 2>&1
t0=$(date +%s)
make -j"$(nproc)" all > "$LOG/build.log" 2>&1 || { tail -30 "$LOG/build.log"; echo "gpu-all: BUILD FAILED"; exit 1; }
echo "gpu-all: built in $(( $(date +%s) - t0 )) s"
MT_GPU_LOGS="$LOG/test-gpu" make --no-print-directory test-gpu > "$LOG/test-gpu.log" 2>&1
tg=$?
tail -25 "$LOG/test-gpu.log"
BENCH_OUT="$LOG/bench" make --no-print-directory bench > "$LOG/bench.log" 2>&1
bb=$?
cat "$LOG/bench/summary.txt" 2>/dev/null || tail -20 "$LOG/bench.log"
make --no-print-directory run CONFIG=configs/tiny.yaml > "$LOG/run.log" 2>&1
rr=$?
grep -E "backend|mesh|^step +(1|300)/" "$LOG/run.log" | head -6
echo "gpu-all: test-gpu rc=$tg bench rc=$bb run rc=$rr, $(( $(date +%s) - t0 )) s in all"
