#!/usr/bin/env bash
# Each GEMM kind of the bench step and the attention at the card's power cap (tools/bench_soak.c):
# build/tools/bench_soak runs each back to back for SECS seconds while nvidia-smi samples the SM
# clock and the power every 100 ms; one row a kind with its TFLOPS over the second half of its run,
# the median clock and power over the same seconds, and its share of the tensor pipe at that clock.
#
#   scripts/bench-soak.sh [BUILD] [SECS] [KIND ...]     (BUILD default build, SECS 6, all kinds)
#
# SOAK_OUT=dir keeps bench_soak's output and the samples (default: a temporary directory). The GPU
# is the first one CUDA_VISIBLE_DEVICES names (default 0). Without a GPU: bench_soak says so, exit 0.
set -u
B=${1:-build}
SECS=${2:-6}
shift $(( $# > 2 ? 2 : $# ))
BIN="$B/tools/bench_soak"
[ -x "$BIN" ] || { echo "bench-soak: $BIN not found (make tools)"; exit 2; }
OUT=${SOAK_OUT:-$(mktemp -d /tmp/mt_soak_XXXXXX)}
mkdir -p "$OUT"
GPU=${CUDA_VISIBLE_DEVICES:-0}
GPU=${GPU%%,*}
SMI_PID=
if command -v nvidia-smi > /dev/null 2>&1 && [ -n "$GPU" ]; then
    nvidia-smi -i "$GPU" --query-gpu=timestamp,power.draw,clocks.sm --format=csv,noheader,nounits -lms 100 \
        > "$OUT/smi.csv" 2> /dev/null &
    SMI_PID=$!
fi
"$BIN" "$SECS" "$@" > "$OUT/soak.txt" 2>&1
rc=$?
[ -n "$SMI_PID" ] && kill "$SMI_PID" 2> /dev/null && wait "$SMI_PID" 2> /dev/null
if [ $rc -ne 0 ]; then
    cat "$OUT/soak.txt"
    echo "bench-soak: bench_soak exited $rc"
    exit $rc
fi
touch "$OUT/smi.csv"
python3 - "$OUT/soak.txt" "$OUT/smi.csv" <<'PY'
import datetime, statistics, sys

samples = []  # (epoch seconds, W, MHz); nvidia-smi writes local time
for line in open(sys.argv[2]):
    f = [x.strip() for x in line.split(",")]
    try:
        t = datetime.datetime.strptime(f[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
        samples.append((t, float(f[1]), float(f[2])))
    except (ValueError, IndexError):
        pass
sms = fpc = None
rows = []
for line in open(sys.argv[1]):
    f = line.split()
    if f and f[0] == "device":
        sms, fpc = int(f[f.index("sms") + 1]), int(f[f.index("flop_per_clock") + 1])
        print(line.rstrip())
    elif f and f[0] == "phase":
        name, t1, t2, tflops = f[1], float(f[3]), float(f[4]), float(f[-2])
        w = [s for s in samples if t1 <= s[0] <= t2]
        if w and sms:
            mhz, watts = statistics.median(s[2] for s in w), statistics.median(s[1] for s in w)
            share = tflops * 1e12 / (sms * fpc * mhz * 1e6) * 100
            rows.append(f"| {name} | {tflops:.0f} | {mhz:.0f} | {watts:.0f} | {share:.1f}% |")
        else:
            rows.append(f"| {name} | {tflops:.0f} | - | - | - |")
    elif line.strip():
        print(line.rstrip())
if rows:
    print("| kind | TFLOPS | SM MHz | W | tensor pipe per clock |")
    print("|---|---:|---:|---:|---:|")
    print("\n".join(rows))
PY
