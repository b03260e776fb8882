#!/usr/bin/env bash
# `make bench-scaling` on a machine with 4 or more GPUs: the bench config (configs/bench-qwen3-30b-8l.yaml,
# 65,536 tokens per optimizer step per GPU) on every mesh of SCALING_MESHES that fits the GPUs
# present, each with its all-to-all micro-benchmark. Prints tokens/s per GPU, MFU, peak memory
# (nvidia-smi, sampled every 200 ms) beside the plan the training prints for its peak rank, and the
# scaling efficiency against REF_1GPU (tokens/s of 1 GPU; measured here first unless given).
#   scripts/bench-scaling.sh [BUILD]     SCALING_MESHES="4:4 4:2 8:8 8:4" (gpus:ep; ep_fsdp = gpus/ep)
# FULL_MODEL=1 adds, when 8 GPUs are present, three steps of the full 48-layer Qwen3-30B-A3B
# (configs/qwen3-30b-a3b.yaml, synthetic data, EP=8, 2 sequences per GPU per step) with its peak
# memory beside its plan.
set -euo pipefail
BUILD=${1:-build}
OUT=${BENCH_OUT:-$BUILD/bench-scaling}
CONFIG=${BENCH_CONFIG:-configs/bench-qwen3-30b-8l.yaml}
STEPS=${BENCH_STEPS:-6}
MESHES=${SCALING_MESHES:-"4:4 4:2 8:8 8:4"}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 NCCL_NVLS_ENABLE=0
mkdir -p "$OUT"
ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
[ "$ngpu" -gt 0 ] || { echo "bench-scaling: no GPU here"; exit 1; }
make --no-print-directory BUILD="$BUILD" "$BUILD/tools/bench_alltoall" > /dev/null

run_mesh() {  # n ep [config tag extra --set args...] -> one JSON line
    local n=$1 ep=$2 cfg=${3:-$CONFIG} tag=${4:-n$1_ep$2}
    shift 4 2>/dev/null || shift $#
    local sets=(--set train.global_batch_size=$((16 * n)) --set parallel.expert_parallel_size="$ep"
                --set train.steps="$STEPS" --set log.metrics="$OUT/$tag.jsonl" "$@")
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 > "$OUT/$tag.mem" 2>/dev/null &
    local smi=$!
    local rc=0
    mpirun --oversubscribe --bind-to none -np "$n" "$BUILD/moetrain" train "$cfg" "${sets[@]}" \
        > "$OUT/$tag.log" 2>&1 || rc=$?
    kill $smi 2>/dev/null || true
    wait $smi 2>/dev/null || true
    if [ $rc -ne 0 ]; then
        tail -3 "$OUT/$tag.log" >&2
        echo "{\"gpus\": $n, \"ep\": $ep, \"error\": \"exit $rc, see $OUT/$tag.log\"}"
        return
    fi
    # the plan of the job's own GPUs, from its memory line (`moetrain plan` decides the auto
    # settings for 80 GB ones)
    local plan_gib
    plan_gib=$(awk '/^memory: peak/ { for (i = 1; i < NF; i++) if ($i == "plan") {
                   print ($(i + 2) ~ /^MiB/ ? $(i + 1) / 1024 : $(i + 1)); exit } }' "$OUT/$tag.log")
    local a2a=""
    [ "$ep" -ge 2 ] && a2a=$(mpirun --oversubscribe --bind-to none -np "$ep" "$BUILD/tools/bench_alltoall" 8192 20 2>&1 | tail -1)
    python3 - "$OUT/$tag.jsonl" "$OUT/$tag.mem" "$n" "$ep" "${plan_gib:-0}" "$a2a" <<'PY'
import json, re, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
steady = rows[2:] or rows
n, ep = int(sys.argv[3]), int(sys.argv[4])
mem = max((int(x) for x in open(sys.argv[2]) if x.strip().isdigit()), default=0) / 1024
m = re.search(r"([0-9.]+) GB/s", sys.argv[6])
print(json.dumps({"gpus": n, "ep": ep, "ep_fsdp": n // ep,
                  "step_ms": statistics.median(r["step_ms"] for r in steady),
                  "tok_s_per_gpu": statistics.median(r["tokens_per_s"] for r in steady) / n,
                  "mfu": statistics.median(r["mfu"] for r in steady), "peak_gib": round(mem, 1),
                  "plan_gib": float(sys.argv[5]), "a2a_gb_s": float(m.group(1)) if m else None}))
PY
}

ref=${REF_1GPU:-}
if [ -z "$ref" ]; then
    echo "bench-scaling: 1 GPU reference ..."
    ref=$(run_mesh 1 1 | python3 -c 'import json,sys; print(json.load(sys.stdin).get("tok_s_per_gpu", 0))')
fi
echo "bench-scaling: 1 GPU reference $ref tokens/s"
: > "$OUT/results.jsonl"
for m in $MESHES; do
    n=${m%%:*} ep=${m##*:}
    [ "$n" -le "$ngpu" ] || { echo "bench-scaling: $n GPUs for EP=$ep: only $ngpu here, not run"; continue; }
    echo "bench-scaling: $n GPUs, EP=$ep x EP_FSDP=$((n / ep)) ..."
    run_mesh "$n" "$ep" | tee -a "$OUT/results.jsonl"
done
if [ "${FULL_MODEL:-0}" = 1 ] && [ "$ngpu" -ge 8 ]; then
    echo "bench-scaling: the full 48-layer Qwen3-30B-A3B on 8 GPUs, EP=8, 3 steps ..."
    STEPS=3 run_mesh 8 8 configs/qwen3-30b-a3b.yaml full48_ep8 --set data.kind=synthetic \
        --set data.path= --set train.global_batch_size=16 --set train.warmup_steps=1 \
        --set checkpoint.dir= --set checkpoint.export_hf= \
        | tee -a "$OUT/full_model.jsonl"
fi
python3 - "$OUT/results.jsonl" "$ref" <<'PY' | tee "$OUT/summary.txt"
import json, sys
ref = float(sys.argv[2])
print(f"{'GPUs':>4} {'mesh':<16}{'tok/s/GPU':>10}{'MFU':>7}{'vs 1 GPU':>9}{'peak GiB':>9}{'plan GiB':>9}{'a2a GB/s':>9}")
for l in open(sys.argv[1]):
    r = json.loads(l)
    mesh = f"EP={r['ep']}" + (f" x FSDP={r['gpus'] // r['ep']}" if r['gpus'] > r['ep'] else "")
    if "error" in r:
        print(f"{r['gpus']:>4} {mesh:<16} {r['error']}")
        continue
    a2a = f"{r['a2a_gb_s']:.0f}" if r.get("a2a_gb_s") else "-"
    eff = f"{100 * r['tok_s_per_gpu'] / ref:.0f}%" if ref else "-"
    print(f"{r['gpus']:>4} {mesh:<16}{r['tok_s_per_gpu']:>10.0f}{100 * r['mfu']:>6.1f}%{eff:>9}"
          f"{r['peak_gib']:>9.1f}{r['plan_gib']:>9.1f}{a2a:>9}")
PY
