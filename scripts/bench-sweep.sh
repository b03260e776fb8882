#!/usr/bin/env bash
# `make bench-sweep` on a GPU machine: moetrain on one GPU against the compiled PyTorch baseline
# (tools/hf_baseline.py) over training shapes a user would pick, each pair run back to back in the
# same job with the same shapes and 65,536 tokens per optimizer step. Appends one row per shape
# to BENCH_OUT/sweep.tsv (default build/bench-sweep) and prints the table as markdown at the end.
#
# SWEEP_SHAPES: space-separated "model:layers:seq:micro_batch" (model 30b = Qwen3-30B-A3B layer
# shapes, 235b = Qwen3-235B-A22B's: hidden 4096, expert width 1536, 64/4 heads). Layers "auto" =
# as many as one GPU holds beside moetrain's fp32 master and Adam state (8 of 30B on 141 GB, 4 on
# 80 GB; 2 of 235B on 141 GB, 1 on 80 GB). SWEEP_TIMEOUT: seconds per run (default 300); SWEEP_BASELINE=0 runs moetrain
# only. SWEEP_ROUNDS=n (1-9, default 1): each shape's pair n times, moetrain and the baseline
# alternating, the row holding the medians (a card's clock drifts at its power cap, so one pair's
# ratio moves by ~3%; docs/benchmarks.md, thirty-second session). SWEEP_BASELINE_CMD: the baseline's
# command (default python3 tools/hf_baseline.py; its last line is JSON with tok_s).
# SWEEP_GPUS=n (default: every GPU CUDA_VISIBLE_DEVICES shows, or nvidia-smi lists): the shapes are
# dealt out round-robin to n GPUs, one sweep a GPU at once, each line of output prefixed with its
# GPU; each pair still runs alone on its GPU, and the rows are merged into BENCH_OUT/sweep.tsv.
# SWEEP_GPUS=1: every shape on the first GPU, one after another.
# Exits 0 unless no moetrain run finished.
set -uo pipefail
BUILD=${1:-build}
OUT=${BENCH_OUT:-$BUILD/bench-sweep}
CONFIG=configs/bench-qwen3-30b-8l.yaml
STEPS=${SWEEP_STEPS:-6}
TIMEOUT=${SWEEP_TIMEOUT:-300}
ROUNDS=${SWEEP_ROUNDS:-1}
BASELINE=${SWEEP_BASELINE_CMD:-python3 tools/hf_baseline.py}
case $ROUNDS in [1-9]) ;; *) echo "bench-sweep: SWEEP_ROUNDS=$ROUNDS: expected 1 to 9"; exit 2;; esac
TOKENS=65536
SHAPES=${SWEEP_SHAPES:-"30b:auto:4096:2 30b:auto:4096:1 30b:auto:2048:4 30b:auto:1024:8 30b:auto:8192:1 235b:auto:4096:1"}
mkdir -p "$OUT"
nvidia-smi -L > /dev/null 2>&1 || { echo "bench-sweep: no GPU here"; exit 1; }
# nvidia-smi ignores CUDA_VISIBLE_DEVICES: ask it about the GPU the runs use (the first visible),
# so that two sweeps on two GPUs of one machine each sample their own clock
smi_gpu=()
[ -n "${CUDA_VISIBLE_DEVICES:-}" ] && smi_gpu=(-i "${CUDA_VISIBLE_DEVICES%%,*}")
gpu_name=$(nvidia-smi "${smi_gpu[@]}" --query-gpu=name --format=csv,noheader | head -1)
mem_mib=$(nvidia-smi "${smi_gpu[@]}" --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
day=$(date -u +%Y-%m-%d)
[ -f "$OUT/sweep.tsv" ] || printf 'date\tgpu\tmodel\tlayers\tseq\tmicro_batch\tmoetrain_tok_s\tmoetrain_mfu\tbaseline_tok_s\tratio\tmoetrain_mhz\tbaseline_mhz\n' > "$OUT/sweep.tsv"

print_table() {  # BENCH_OUT/sweep.tsv (every row so far) as markdown, also into sweep.md
    python3 - "$OUT/sweep.tsv" <<'PY' | tee "$OUT/sweep.md"
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1]), delimiter="\t"))
print("| date | GPU | model | layers | seq | micro-batch | moetrain tok/s | MFU | compiled PyTorch tok/s | ratio | SM MHz (moetrain / baseline) |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
f = lambda v, fmt: fmt.format(float(v)) if v not in ("-", "", "-1") else "-"
for r in rows:
    print(f"| {r['date']} | {r['gpu']} | {r['model']} | {r['layers']} | {r['seq']} | {r['micro_batch']} | "
          f"{f(r['moetrain_tok_s'], '{:,.0f}')} | {f(r['moetrain_mfu'], '{:.1%}')} | {f(r['baseline_tok_s'], '{:,.0f}')} | "
          f"{r['ratio']}{'x' if r['ratio'] != '-' else ''} | {r.get('moetrain_mhz') or '-'} / {r.get('baseline_mhz') or '-'} |")
PY
}

# Several GPUs: this script again on each, with its share of the shapes (SWEEP_GPUS above)
visible=()
if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
    IFS=, read -r -a visible <<< "$CUDA_VISIBLE_DEVICES"
else
    mapfile -t visible < <(nvidia-smi -L 2>/dev/null | sed -n 's/^GPU \([0-9][0-9]*\):.*/\1/p')
fi
read -r -a shape_list <<< "$SHAPES"
n_par=${SWEEP_GPUS:-${#visible[@]}}
case $n_par in ''|*[!0-9]*|0) echo "bench-sweep: SWEEP_GPUS=$n_par: expected a number of GPUs, 1 or more"; exit 2;; esac
[ "$n_par" -gt "${#visible[@]}" ] && n_par=${#visible[@]}
[ "$n_par" -gt "${#shape_list[@]}" ] && n_par=${#shape_list[@]}
if [ "$n_par" -gt 1 ]; then
    echo "bench-sweep: ${#shape_list[@]} shapes over $n_par GPUs (${visible[*]:0:$n_par}), one sweep a GPU at once"
    pids=()
    for i in $(seq 0 $((n_par - 1))); do
        g=${visible[$i]} part=""
        for j in "${!shape_list[@]}"; do [ $((j % n_par)) -eq "$i" ] && part="$part ${shape_list[$j]}"; done
        rm -f "$OUT/gpu$g/sweep.tsv" # this run's rows only, merged below
        ( SWEEP_GPUS=1 SWEEP_NO_TABLE=1 SWEEP_SHAPES="${part# }" CUDA_VISIBLE_DEVICES=$g BENCH_OUT="$OUT/gpu$g" \
              bash "$0" "$BUILD" 2>&1 | sed -u "s/^/[GPU $g] /"; exit "${PIPESTATUS[0]}" ) &
        pids+=($!)
    done
    ok=0
    for pid in "${pids[@]}"; do wait "$pid" && ok=1; done
    for i in $(seq 0 $((n_par - 1))); do
        f="$OUT/gpu${visible[$i]}/sweep.tsv"
        [ -f "$f" ] && tail -n +2 "$f" >> "$OUT/sweep.tsv"
    done
    print_table
    [ "$ok" = 1 ]
    exit
fi

# a command with the GPU's power and SM clock sampled every 250 ms into $1.clk (the cards train at
# their power cap, at clocks that differ from card to card: docs/benchmarks.md, twenty-first session)
clocked() {
    local clk=$1.clk; shift
    nvidia-smi "${smi_gpu[@]}" --query-gpu=power.draw,clocks.sm --format=csv,noheader,nounits -lms 250 > "$clk" 2>/dev/null &
    local smi=$!
    "$@"
    local rc=$?
    kill $smi 2>/dev/null; wait $smi 2>/dev/null
    return $rc
}

busy_mhz() {  # the median SM clock over the samples drawing at least half the largest power, or -
    python3 - "$1" <<'PY' 2>/dev/null || echo -
import statistics, sys
rows = []
for line in open(sys.argv[1]):
    try:
        rows.append(tuple(float(x) for x in line.split(",")))
    except ValueError:
        pass
busy = [m for w, m in rows if w >= 0.5 * max(r[0] for r in rows)] if rows else []
print(f"{statistics.median(busy):.0f}" if busy else "-")
PY
}

median() {  # the median of the numbers given (- entries skipped), or - when there are none
    python3 -c '
import statistics, sys
v = [float(x) for x in sys.argv[1:] if x != "-"]
m = statistics.median(v) if v else None
print("-" if m is None else int(m) if m == int(m) else m)' "$@"
}

median_tok_s() {  # metrics.jsonl -> "tok/s mfu" over the steps after the first two
    python3 - "$1" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
steady = rows[2:] or rows
print(statistics.median(r["tokens_per_s"] for r in steady), statistics.median(r.get("mfu", -1) or -1 for r in steady))
PY
}

ran=0
for shape in $SHAPES; do
    IFS=: read -r model layers seq mb <<< "$shape"
    case $model in
        30b) shape_set=(); base_env=(); per_layer_gib=11 ;;
        235b) shape_set=(--set model.hidden_size=4096 --set model.moe_intermediate_size=1536
                         --set model.num_attention_heads=64 --set model.num_key_value_heads=4
                         --set model.intermediate_size=12288)
              base_env=(HIDDEN=4096 MOE_I=1536 HEADS=64 KV_HEADS=4); per_layer_gib=40 ;;
        *) echo "bench-sweep: unknown model '$model' in '$shape' (30b or 235b)"; continue ;;
    esac
    if [ "$layers" = auto ]; then
        layers=$(( (mem_mib / 1024 - 30) / per_layer_gib ))
        [ "$layers" -gt 8 ] && layers=8
        [ "$layers" -lt 1 ] && layers=1
    fi
    gbs=$(( TOKENS / seq ))
    if [ $(( gbs % mb )) -ne 0 ] || [ "$gbs" -lt 1 ]; then echo "bench-sweep: $shape: $TOKENS tokens are not whole micro-batches"; continue; fi
    tag="${model}_l${layers}_s${seq}_b${mb}"
    mts=() mfus=() bases=() mhz_mts=() mhz_bases=()
    for round in $(seq 1 "$ROUNDS"); do
        rtag=$tag; [ "$ROUNDS" -gt 1 ] && rtag="${tag}_r$round"
        echo "bench-sweep: $rtag: moetrain ..."
        if clocked "$OUT/$rtag.moetrain" timeout "$TIMEOUT" mpirun --oversubscribe --bind-to none -np 1 "$BUILD/moetrain" train "$CONFIG" \
                "${shape_set[@]}" --set model.num_hidden_layers="$layers" --set model.max_position_embeddings="$seq" \
                --set train.seq_len="$seq" --set train.micro_batch_size="$mb" --set train.global_batch_size="$gbs" \
                --set train.steps="$STEPS" --set log.metrics="$OUT/$rtag.jsonl" > "$OUT/$rtag.moetrain.log" 2>&1; then
            read -r t u <<< "$(median_tok_s "$OUT/$rtag.jsonl")"
            mts+=("$t"); mfus+=("$u"); mhz_mts+=("$(busy_mhz "$OUT/$rtag.moetrain.clk")")
            echo "  $rtag: moetrain $t tok/s (MFU $u)" # each run as it ends: a sweep cut short still says what it measured
        else
            echo "  moetrain failed or timed out: $(tail -1 "$OUT/$rtag.moetrain.log")"
        fi
        if [ "${SWEEP_BASELINE:-1}" = 0 ]; then
            echo "bench-sweep: $rtag: PyTorch baseline not run (SWEEP_BASELINE=0)"
        elif echo "bench-sweep: $rtag: PyTorch baseline ..." && clocked "$OUT/$rtag.baseline" timeout "$TIMEOUT" env "${base_env[@]}" LAYERS="$layers" SEQ="$seq" BATCH="$mb" ACCUM=$(( gbs / mb )) \
                $BASELINE > "$OUT/$rtag.baseline.log" 2>&1; then
            bases+=("$(tail -1 "$OUT/$rtag.baseline.log" | python3 -c 'import json,sys; print(json.loads(sys.stdin.read())["tok_s"])')")
            mhz_bases+=("$(busy_mhz "$OUT/$rtag.baseline.clk")")
            echo "  $rtag: baseline ${bases[${#bases[@]}-1]} tok/s"
        else
            echo "  baseline failed or timed out: $(tail -1 "$OUT/$rtag.baseline.log")"
        fi
    done
    mt=$(median "${mts[@]}") mfu=$(median "${mfus[@]}") base=$(median "${bases[@]}") ratio="-"
    mhz_mt=$(median "${mhz_mts[@]}") mhz_base=$(median "${mhz_bases[@]}")
    if [ "$mt" != - ] && [ "$base" != - ]; then ratio=$(python3 -c "print(f'{$mt / $base:.2f}')"); fi
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$day" "$gpu_name" "$model" "$layers" "$seq" "$mb" "$mt" "$mfu" "$base" "$ratio" "$mhz_mt" "$mhz_base" >> "$OUT/sweep.tsv"
    each=""; [ "$ROUNDS" -gt 1 ] && each=" (rounds: moetrain ${mts[*]:-none}; baseline ${bases[*]:-none})"
    echo "  moetrain $mt tok/s (MFU $mfu, $mhz_mt MHz), baseline $base tok/s ($mhz_base MHz): ${ratio}x$each"
    [ "$mt" != - ] && ran=$((ran + 1))
done

[ "${SWEEP_NO_TABLE:-0}" = 1 ] || print_table
[ "$ran" -gt 0 ]
