#!/usr/bin/env bash
# The MoE all-to-all micro-benchmark (tools/bench_alltoall) on N GPUs at two sizes -- one layer's
# rows at top-8 (8192 tokens x 8 rows) and the token-once volume of EP=2 (about 2 rows a token) --
# under NCCL's defaults and a few NCCL settings that change how point-to-point traffic moves over
# NVLink, then the other ways of moving the same bytes (tools/bench_alltoall_ce: registered NCCL buffers,
# NCCL's copy-engine AlltoAll, CUDA IPC copies) at the same sizes. First the copy engines' own
# ceiling between GPUs 0 and 1 (tools/bench_p2p_ceiling). Prints one line per run.
#   scripts/bench-a2a.sh [BUILD] [N]
set -u
BUILD=${1:-build}
N=${2:-2}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 NCCL_NVLS_ENABLE=0
make --no-print-directory BUILD="$BUILD" "$BUILD/tools/bench_alltoall" "$BUILD/tools/bench_alltoall_ce" \
    "$BUILD/tools/bench_p2p_ceiling" > /dev/null || exit 1
"$BUILD/tools/bench_p2p_ceiling"
settings=("" "NCCL_P2P_NVL_CHUNKSIZE=2097152" "NCCL_MIN_P2P_NCHANNELS=32 NCCL_MAX_P2P_NCHANNELS=32"
          "NCCL_PROTO=Simple NCCL_P2P_NVL_CHUNKSIZE=4194304")
# (NCCL_P2P_USE_CUDA_MEMCPY=1 hung the 2-rank run on an H200 host, 2026-11-22: left out)
for s in "${settings[@]}"; do
    for tokens in 8192 2048; do
        line=$(env $s mpirun --oversubscribe --bind-to none -np "$N" "$BUILD/tools/bench_alltoall" \
               "$tokens" 20 2>&1 | tail -4)
        echo "[${s:-NCCL defaults}] $line"
    done
done
for mode in nccl nccl-reg nccl-regc nccl-ce ipc ipc4; do
    for tokens in 8192 2048; do
        out=$(NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=TUNING timeout 120 mpirun --oversubscribe --bind-to none \
              -np "$N" "$BUILD/tools/bench_alltoall_ce" "$mode" "$tokens" 20 2>&1)
        echo "$out" | grep -m1 -i "copy engine"
        echo "$out" | grep -v "NCCL INFO" | tail -1
    done
done
