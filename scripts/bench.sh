#!/usr/bin/env bash
# `make bench` on a GPU machine: moetrain on configs/bench-qwen3-30b-8l.yaml on 1 GPU and (with 2+
# GPUs) with EP=2 on 2 GPUs, then the PyTorch baseline (tools/hf_baseline.py, torch.compile'd
# transformers, same shapes and tokens per step) in the same job, and moetrain on 1 GPU on the sm_80
# (A100) path (MT_FORCE_SM80=1; BENCH_SM80=0 skips it). Prints one table, what it skipped, and a
# `headline:` line (the 1-GPU run against the baseline; docs/benchmarks.md starts with the latest);
# logs and JSON lines go to BENCH_OUT (default build/bench). Exits 0 unless the 1-GPU run failed.
# With 2+ GPUs it also says how the EP=2 run's throughput per GPU compares with one GPU's (GPU 0
# alone, GPU 1 alone, and the slower of the two, whose pace an EP=2 step keeps) and how
# unevenly the routing loaded the two ranks (`ep load`, docs/scaling.md), profiles an EP=2 step and
# times the all-to-all (BENCH_A2A=0 skips that micro-benchmark). Where build/tools/libmt_trace.so
# was built (CUPTI), a traced 4-step run gives the last step's kernel timeline: GPU busy and idle
# time and the largest kernels (BENCH_TRACE=0 skips it; tools/trace_gaps.py reads the CSV); with
# 2+ GPUs a traced EP=2 run gives each rank's idle time, split into the part while the other rank's
# GPU ran (waiting for its work) and the part both idled (host waits, latencies).
set -euo pipefail
# never NVLink multicast: on shared hosts a program using it can take the GPUs out of service
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
BUILD=${1:-build}
OUT=${BENCH_OUT:-$BUILD/bench}
CONFIG=${BENCH_CONFIG:-configs/bench-qwen3-30b-8l.yaml}
STEPS=${BENCH_STEPS:-8}
# BENCH_MICRO_BATCH=4: sequences per micro-step (the config's 2 by default); tokens per step stay
EXTRA=()
[ -n "${BENCH_MICRO_BATCH:-}" ] && EXTRA=(--set train.micro_batch_size="$BENCH_MICRO_BATCH")
mkdir -p "$OUT"
ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
# nvidia-smi lists every GPU, CUDA_VISIBLE_DEVICES narrows what moetrain and the baseline see:
# count those (an EP=2 row on one visible GPU puts both ranks on it), and the second GPU's run
# takes the second of them
visible=()
if [ -n "${CUDA_VISIBLE_DEVICES+x}" ]; then
    IFS=, read -r -a visible <<< "$CUDA_VISIBLE_DEVICES"
    [ "${#visible[@]}" -lt "$ngpu" ] && ngpu=${#visible[@]}
fi
second_gpu=${visible[1]:-1}
[ "$ngpu" -gt 0 ] || { echo "bench: no GPU here${CUDA_VISIBLE_DEVICES+ (CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES)}"; exit 1; }
gpu_name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
# The 8-layer config needs 96 GiB before auto's expert-row pairs and groups take the room left
# (`plan --set parallel.expert_wgrad_pairs=false --set train.weight_copy=keep`: split fp32 master
# and fp32 Adam moments, ~9 GiB a layer; 124 GiB measured on an H200 with the groups);
# a GPU with less memory (H100 and A100 80 GB: 79 GiB) runs 4 layers, moetrain and the baseline
# alike, and says so. BENCH_LAYERS overrides.
mem_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
LAYERS=${BENCH_LAYERS:-$([ "${mem_mib:-0}" -ge 120000 ] && echo 8 || echo 4)}
if [ "$LAYERS" != 8 ]; then
    EXTRA+=(--set model.num_hidden_layers="$LAYERS")
    echo "bench: $LAYERS layers instead of the config's 8 ($gpu_name: $((mem_mib / 1024)) GiB; 8 layers need ~96 GiB)"
fi

# peak device memory of a command: nvidia-smi sampled every 200 ms, max over GPUs and time; beside
# it the power draw and SM clock (every 250 ms), since the cards train at their power cap and the
# clock they keep there differs from card to card (docs/benchmarks.md, twenty-first session)
run_sampled() {
    local tag=$1; shift
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 > "$OUT/$tag.mem" 2>/dev/null &
    local smi=$!
    nvidia-smi --query-gpu=power.draw,clocks.sm --format=csv,noheader,nounits -lms 250 > "$OUT/$tag.clk" 2>/dev/null &
    local clk=$!
    set +e
    "$@" > "$OUT/$tag.log" 2>&1
    local rc=$?
    set -e
    kill $smi $clk 2>/dev/null || true
    wait $smi $clk 2>/dev/null || true
    return $rc
}

# "<median SM MHz> MHz at <median W> W" over the busy samples of a run (power at least half the
# largest sampled), or nothing
clock_of() {
    python3 - "$OUT/$1.clk" <<'PY' 2>/dev/null || true
import statistics, sys
rows = []
for line in open(sys.argv[1]):
    try:
        w, mhz = (float(x) for x in line.split(","))
        rows.append((w, mhz))
    except ValueError:
        pass
busy = [r for r in rows if rows and r[0] >= 0.5 * max(w for w, _ in rows)]
if busy:
    print(f"{statistics.median(m for _, m in busy):.0f} MHz at {statistics.median(w for w, _ in busy):.0f} W")
PY
}

summary() {  # tag ngpu -> "tok/s per GPU | mfu | peak GiB"
    python3 - "$OUT/$1.jsonl" "$OUT/$1.mem" "$2" <<'PY'
import json, sys, statistics
rows = [json.loads(l) for l in open(sys.argv[1])]
steady = rows[2:] or rows            # the first steps include allocation and warm-up
ms = statistics.median(r["step_ms"] for r in steady)
tps = statistics.median(r["tokens_per_s"] for r in steady) / int(sys.argv[3])
mfu = statistics.median(r.get("mfu", -1) for r in steady)
mem = max((int(x) for x in open(sys.argv[2]) if x.strip().isdigit()), default=0) / 1024
out = {"step_ms": ms, "tok_s_per_gpu": tps, "mfu": mfu, "peak_gib": mem, "loss": rows[-1]["loss"]}
ep_load = [max(r["ep_load_max"]) for r in steady if r.get("ep_load_max")]  # with EP: per step, max over layers
if ep_load:
    out["ep_load"] = [min(ep_load), max(ep_load)]
print(json.dumps(out))
PY
}

declare -A res
skipped=()
# bench_moetrain TAG N [mpirun env args]: moetrain on N GPUs with EP=N into res[TAG]
bench_moetrain() {
    local tag=$1 n=$2
    shift 2
    if run_sampled "$tag" mpirun --oversubscribe --bind-to none -np "$n" "$@" "$BUILD/moetrain" train "$CONFIG" \
            --set train.global_batch_size=$((16 * n)) --set parallel.expert_parallel_size="$n" \
            --set train.steps="$STEPS" --set log.metrics="$OUT/$tag.jsonl" "${EXTRA[@]}"; then
        res[$tag]=$(summary "$tag" "$n")
    else
        res[$tag]='{"error": "failed, see '"$OUT/$tag.log"'"}'
        tail -5 "$OUT/$tag.log"
    fi
    echo "  ${res[$tag]}"
}
for n in 1 2; do
    if [ "$n" -gt "$ngpu" ]; then
        skipped+=("moetrain on $n GPUs with EP=$n ($ngpu GPU here)")
        res[moetrain_${n}gpu]='{"error": "skipped: '"$ngpu"' GPU here"}'
        continue
    fi
    echo "bench: moetrain on $n GPU(s) ..."
    bench_moetrain "moetrain_${n}gpu" "$n"
done
# An EP=2 step goes at its slower card's pace, and cards at the power cap differ by ~2% (docs/
# benchmarks.md, forty-first session): the second GPU alone too, so that EP=2 is also compared
# with the slower card of the pair
res[moetrain_1gpu_b]='{"error": "not run"}'
if [ "$ngpu" -ge 2 ]; then
    echo "bench: moetrain on 1 GPU, the second one (CUDA_VISIBLE_DEVICES=$second_gpu) ..."
    bench_moetrain moetrain_1gpu_b 1 -x CUDA_VISIBLE_DEVICES="$second_gpu"
fi
if [ "${BENCH_SM80:-1}" = 0 ]; then
    skipped+=("moetrain on 1 GPU on the sm_80 path (BENCH_SM80=0)")
    res[moetrain_sm80]='{"error": "not run (BENCH_SM80=0)"}'
else
    echo "bench: moetrain on 1 GPU, sm_80 (A100) path forced (MT_FORCE_SM80=1) ..."
    bench_moetrain moetrain_sm80 1 -x MT_FORCE_SM80=1
fi

# a profiled 3-step run on n GPUs with EP=n (every op timed between syncs); prints its time split
profiled_split() {  # n log
    mpirun --oversubscribe --bind-to none -np "$1" "$BUILD/moetrain" train "$CONFIG" --set train.steps=3 \
        --set train.global_batch_size=$((16 * $1)) --set parallel.expert_parallel_size="$1" \
        --set log.profile=true "${EXTRA[@]}" > "$2" 2>&1 || true
    # no time line (a failed run) leaves the split empty instead of ending the script (pipefail)
    { grep '^    time:' "$2" || true; } | tail -1 | sed 's/^    time: //'
}
echo "bench: moetrain on 1 GPU, profiled (every op timed between syncs) ..."
split=$(profiled_split 1 "$OUT/moetrain_profile.log")
echo "  time split: ${split:-unavailable}"
split2=""
if [ "$ngpu" -ge 2 ]; then
    echo "bench: moetrain on 2 GPUs with EP=2, profiled ..."
    split2=$(profiled_split 2 "$OUT/moetrain_profile_ep2.log")
    echo "  time split: ${split2:-unavailable}"
else
    skipped+=("the profiled EP=2 step ($ngpu GPU here)")
fi

# The kernel timeline of a 4-step run on 1 GPU (tools/kernel_trace.c, preloaded: the GPU's own
# timestamps, no synchronisation added): how long the last step kept the GPU busy and idle, and
# its largest kernels. BENCH_TRACE=0 skips it.
timeline=""
timeline2=""
trace_lib="$BUILD/tools/libmt_trace.so"
if [ "${BENCH_TRACE:-1}" = 0 ]; then
    skipped+=("the kernel timeline (BENCH_TRACE=0)")
elif [ -f "$trace_lib" ]; then
    echo "bench: moetrain on 1 GPU, kernel timeline (CUPTI) ..."
    LD_PRELOAD="$(cd "$(dirname "$trace_lib")" && pwd)/libmt_trace.so" MT_TRACE_OUT="$OUT/timeline.csv" \
        "$BUILD/moetrain" train "$CONFIG" --set train.steps=4 "${EXTRA[@]}" > "$OUT/moetrain_timeline.log" 2>&1 || true
    if python3 tools/trace_gaps.py "$OUT/timeline.csv" --top 3 --small-ops 8 > "$OUT/timeline.txt" 2>&1; then
        timeline=$(python3 - "$OUT/timeline.txt" <<'PY'
import re, sys
text = open(sys.argv[1]).read()
m = re.search(r"over ([0-9.]+) ms; GPU busy ([0-9.]+) ms, idle ([0-9.]+) ms", text)
top = re.findall(r"^ +([0-9.]+) +\d+ +[0-9.]+  (.+)$", text, re.M)
print(f"{m.group(2)} ms busy of {m.group(1)}, idle {m.group(3)} ms; largest: "
      + ", ".join(f"{name} {ms} ms" for ms, name in top))
PY
) || timeline=""
    fi
    gzip -f "$OUT/timeline.csv" 2>/dev/null || true
    echo "  kernel timeline: ${timeline:-unavailable (see $OUT/timeline.txt)}"
    if [ "$ngpu" -ge 2 ]; then
        echo "bench: moetrain on 2 GPUs with EP=2, kernel timelines (CUPTI) ..."
        mpirun --oversubscribe --bind-to none -np 2 -x LD_PRELOAD="$(cd "$(dirname "$trace_lib")" && pwd)/libmt_trace.so" \
            -x MT_TRACE_OUT="$OUT/timeline_ep2_%r.csv" "$BUILD/moetrain" train "$CONFIG" --set train.steps=4 \
            --set train.global_batch_size=32 --set parallel.expert_parallel_size=2 "${EXTRA[@]}" \
            > "$OUT/moetrain_timeline_ep2.log" 2>&1 || true
        for r in 0 1; do
            python3 tools/trace_gaps.py "$OUT/timeline_ep2_$r.csv" --top 3 --peer "$OUT/timeline_ep2_$((1 - r)).csv" \
                --by-next 6 --small-ops 8 > "$OUT/timeline_ep2_$r.txt" 2>&1 || true
        done
        timeline2=$(python3 - "$OUT/timeline_ep2_0.txt" "$OUT/timeline_ep2_1.txt" <<'PY'
import re, sys
parts = []
for r, path in enumerate(sys.argv[1:]):
    text = open(path).read()
    m = re.search(r"over ([0-9.]+) ms; GPU busy [0-9.]+ ms, idle ([0-9.]+) ms", text)
    p = re.search(r"of the [0-9.]+ ms idle, ([0-9.]+) ms while the peer's GPU ran kernels .*?, ([0-9.]+) ms while it idled", text)
    w = re.search(r"host waits in the step: (\d+) synchronisations", text)
    span = f" of {m.group(1)}" if r == 0 else ""
    waits = f"; host waits {w.group(1)}" if w else ""
    parts.append(f"rank {r} idle {m.group(2)} ms{span} ({p.group(1)} while rank {1 - r} ran, {p.group(2)} both idle{waits})")
print("; ".join(parts))
PY
) || timeline2=""
        gzip -f "$OUT"/timeline_ep2_*.csv 2>/dev/null || true
        echo "  EP=2 kernel timelines: ${timeline2:-unavailable (see $OUT/timeline_ep2_0.txt)}"
    fi
else
    skipped+=("the kernel timeline (no $trace_lib: CUPTI was not found when it was built)")
fi

a2a=""
if [ "${BENCH_A2A:-1}" = 0 ]; then
    skipped+=("the all-to-all micro-benchmark (BENCH_A2A=0)")
elif [ "$ngpu" -ge 2 ]; then
    echo "bench: dispatch all-to-all micro-benchmark on 2 GPUs ..."
    make --no-print-directory BUILD="$BUILD" "$BUILD/tools/bench_alltoall" > /dev/null
    # four lines: the MoE layer's path (all_to_all_inbox) one call at a time, back to back, and
    # back to back without the copy to self (the self-last exchanges), then NCCL's all_to_all_v
    a2a=$(mpirun --oversubscribe --bind-to none -np 2 "$BUILD/tools/bench_alltoall" 8192 20 2>&1 | tail -4)
    echo "$a2a" | sed 's/^/  /'
else
    skipped+=("the all-to-all micro-benchmark ($ngpu GPU here)")
fi

if [ "${BENCH_BASELINE:-1}" = 0 ]; then
    res[baseline]='{"error": "not run (BENCH_BASELINE=0)"}'
    skipped+=("the PyTorch baseline (BENCH_BASELINE=0)")
else
    echo "bench: PyTorch baseline (torch.compile, grouped_mm) ..."
    if run_sampled baseline env LAYERS="$LAYERS" SEQ=4096 BATCH=2 ACCUM=8 COMPILE="${BASELINE_COMPILE:-1}" \
            python3 tools/hf_baseline.py; then
        res[baseline]=$(tail -1 "$OUT/baseline.log")
    else
        res[baseline]='{"error": "failed"}'
        tail -5 "$OUT/baseline.log"
    fi
fi
echo "  ${res[baseline]}"

python3 - "$gpu_name" "$LAYERS" "${res[moetrain_1gpu]}" "${res[moetrain_2gpu]}" "${res[moetrain_sm80]}" \
    "${res[baseline]}" "${res[moetrain_1gpu_b]}" <<'PY' | tee "$OUT/summary.txt"
import json, sys
gpu, layers, one, two, sm80, base, one_b = sys.argv[1], sys.argv[2], *(json.loads(a) for a in sys.argv[3:])
b = base.get("tok_s")
print(f"bench on {gpu}: Qwen3-30B-A3B shapes, {layers} layers, seq 4096, 65,536 tokens/step/GPU")
print(f"{'run':<34}{'tok/s/GPU':>12}{'MFU':>8}{'peak GiB':>10}{'vs baseline':>13}")
rows = [("moetrain 1 GPU", one, "tok_s_per_gpu")]
if "tok_s_per_gpu" in one_b:
    rows.append(("moetrain 1 GPU, the second GPU", one_b, "tok_s_per_gpu"))
for name, r, key in (*rows, ("moetrain 2 GPU EP=2", two, "tok_s_per_gpu"),
                     ("moetrain 1 GPU, sm_80 path forced", sm80, "tok_s_per_gpu"),
                     ("PyTorch baseline", base, "tok_s")):
    t = r.get(key)
    if t is None:
        print(f"{name:<34}{'-':>12}  {r.get('error', 'not run')}")
        continue
    mfu = r.get("mfu", r.get("model_tflops", 0) * 1e12 / 989e12 if "model_tflops" in r else -1)
    mem = r.get("peak_gib", r.get("peak_mem_gib", 0))
    ratio = f"{t / b:.3f}x" if b else "-"
    print(f"{name:<34}{t:>12.0f}{100 * mfu:>7.1f}%{mem:>10.1f}{ratio:>13}")
t1, t2 = one.get("tok_s_per_gpu"), two.get("tok_s_per_gpu")
if t1 and t2:
    load = two.get("ep_load")
    why = (f"; ep load {load[0]:.2f}-{load[1]:.2f} over the steps (the busiest rank's expert rows over the"
           " mean rank's: the other waits for it at every exchange)") if load else ""
    tb = one_b.get("tok_s_per_gpu")
    cards = (f" (GPU 0 alone; {100 * t2 / tb:.1f}% of GPU 1 alone, {100 * t2 / min(t1, tb):.1f}% of the slower"
             " card, whose pace the EP=2 step keeps)") if tb else ""
    print(f"EP=2 per GPU: {100 * t2 / t1:.1f}% of 1 GPU{cards}{why}")
PY
clk1=$(clock_of moetrain_1gpu); clkb=$(clock_of baseline)
echo "SM clock at the power cap (median, busy samples): moetrain 1 GPU ${clk1:-unavailable}; baseline ${clkb:-unavailable}" | tee -a "$OUT/summary.txt"
echo "moetrain 1 GPU time split (profiled step): ${split:-unavailable}" | tee -a "$OUT/summary.txt"
if [ -n "$split2" ]; then echo "moetrain 2 GPUs EP=2 time split (profiled step): $split2" | tee -a "$OUT/summary.txt"; fi
if [ -n "$timeline" ]; then echo "moetrain 1 GPU kernel timeline (last of 4 steps): $timeline" | tee -a "$OUT/summary.txt"; fi
if [ -n "$timeline2" ]; then echo "moetrain 2 GPUs EP=2 kernel timelines (last of 4 steps): $timeline2" | tee -a "$OUT/summary.txt"; fi
if [ -n "$a2a" ]; then echo "$a2a" | tee -a "$OUT/summary.txt"; fi
for s in "${skipped[@]}"; do echo "skipped: $s" | tee -a "$OUT/summary.txt"; done

# the headline: the 1-GPU run against the compiled baseline of the same job
where="$gpu_name"
[ "$LAYERS" = 8 ] || where="$gpu_name, $LAYERS layers"
# and against the last recorded one (BENCH_HEADLINE_FILE, default docs/benchmarks.md, first line) on
# the same kind of GPU: a drop past the cards' spread is flagged (twenty-ninth session: a kernel
# change had cost 0.7% a step unseen for a session, no bench having run)
python3 - "$where" "$(date -u +%Y-%m-%d)" "${res[moetrain_1gpu]}" "${res[baseline]}" \
    "${BENCH_HEADLINE_FILE:-docs/benchmarks.md}" <<'PY' | tee -a "$OUT/summary.txt"
import json, re, sys
gpu, day, one, base, recorded = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4]), sys.argv[5]
t, b = one.get("tok_s_per_gpu"), base.get("tok_s")
if t is None:
    print(f"headline: unavailable, the 1-GPU run {one.get('error', 'did not run')} ({gpu}, {day})")
    sys.exit(0)
mfu = f"{100 * one['mfu']:.1f}%" if one.get("mfu", -1) >= 0 else "n/a"
ratio, note = (f"{t / b:.3f}x", "") if b else ("n/a x", ", baseline not run")
print(f"headline: {t:.0f} tok/s, {mfu} MFU, {ratio} compiled PyTorch ({gpu}, {day}{note})")
try:
    first = open(recorded).readline()
except OSError:
    first = ""
m = re.match(r"headline: (\d+) tok/s, \S+ MFU, ([\d.]+|n/a) ?x compiled PyTorch \(([^)]*?), (\d{4}-\d\d-\d\d)", first)
if not m:
    print(f"against the recorded headline: none in {recorded}")
elif m.group(3) != gpu:
    print(f"against the recorded headline: not compared (recorded on {m.group(3)}, {m.group(4)})")
else:
    rt, rr = int(m.group(1)), (float(m.group(2)) if m.group(2) != "n/a" else None)
    dt = 100 * (t / rt - 1)
    dr = 100 * (t / b / rr - 1) if b and rr else None
    drop = dr < -1.5 if dr is not None else dt < -3.0  # past the cards' spread at the power cap
    print(f"{'WARNING: slower than ' if drop else 'against '}the recorded headline ({recorded}: {rt} tok/s, "
          + (f"{rr:.3f}x" if rr else "no ratio") + f", {m.group(4)}): tok/s {dt:+.2f}%"
          + (f", ratio {dr:+.2f}%" if dr is not None else "")
          + ("; A/B this build against the recorded commit's on one card (scripts/ab-train.sh, AB_BUILD_A)"
             if drop else ""))
PY
case "${res[moetrain_1gpu]}" in *error*) exit 1 ;; esac
exit 0
