#!/bin/bash
# Nsight Compute over the step's largest kernels of our own, one launch each at the bench shape: the
# grouped expert GEMMs (`bench_grouped_gemm 0`: forward, dgrad, and the wgrad in groups of eight
# micro-steps, at balanced routing, Zipf-like routing, and Zipf-like in whole 128-row blocks) and
# the attention (`bench_attention 0`).
#
#   scripts/ncu-kernels.sh [BUILD]        (BUILD defaults to build; needs BUILD/tools/bench_*)
#   NCU=/path/to/ncu                      when ncu is not on PATH or in /usr/local/cuda/bin
#   NCU_OUT=dir                           keeps the raw reports there (default: a temporary folder)
#   NCU_SECTIONS="SpeedOfLight WarpStateStats SourceCounters"
#                                         ncu sections to take (default SpeedOfLight, which the
#                                         table needs; the others stay in the raw reports: stall
#                                         reasons, and with SourceCounters their source lines,
#                                         since the build passes -lineinfo)
#   NCU_CLOCK=none                        leaves the clock to the card (ncu's --clock-control
#                                         none): the SM GHz column then says what clock each
#                                         kernel ran at, e.g. under the power cap (default base)
#   scripts/ncu-kernels.sh --table FILE   only the table of an ncu text report already taken
#
# One row a launch: its duration, the SM clock (ncu locks it at the card's base clock, so the rows
# compare per clock, not at the clock a power-capped step holds), and the busiest SM unit's share
# of its peak ("Compute (SM) Throughput"; in these kernels ncu names the tensor pipe as that unit),
# the SMs' average active cycles in % of the kernel's elapsed cycles (what the busiest unit's % loses
# to SMs with no work: a last wave's tail, a launch's start and end), DRAM and L2 throughput in %
# of peak. Why: the step's kernel timeline gives milliseconds, and the
# card's average clock cannot say whether a GEMM is short of its peak or of its clock; this can.
set -euo pipefail

# the report's kernel records -> markdown rows; "launch: WHAT" lines printed by the program name
# the records in order (bench_grouped_gemm 0); without them the column stays empty
ncu_table() {
    awk '
    function num(s) { gsub(",", "", s); return s + 0 }
    function flush() {
        if (!name) return
        n++
        what = (n in label) ? label[n] : ""
        active = elapsed > 0 && sm_active >= 0 ? 100 * sm_active / elapsed : -1
        printf "| %d | %s | %s | %s | %.3f | %.2f | %.1f | %.1f | %.1f | %.1f |\n", n, name, what, grid, ms, ghz, sm, active, dram, l2
        name = ""
    }
    /^launch: / { labels++; label[labels] = substr($0, 9); next }
    /^  [^ ].*\([0-9]+, [0-9]+, [0-9]+\)x\([0-9]+, [0-9]+, [0-9]+\), Context/ {
        flush()
        head = $0; sub(/^ +/, "", head)
        name = head; sub(/\(.*/, "", name); sub(/.*::/, "", name)
        match(head, /\([0-9]+, [0-9]+, [0-9]+\)x/)
        grid = substr(head, RSTART + 1, RLENGTH - 3); gsub(/ /, "", grid)
        ms = ghz = sm = dram = l2 = elapsed = sm_active = -1
        next
    }
    name && /^    Duration / { v = num($NF); u = $(NF - 1)
        ms = u == "ns" ? v / 1e6 : u == "us" ? v / 1e3 : u == "ms" ? v : u == "s" ? v * 1e3 : -1 }
    name && /^    SM Frequency / { v = num($NF); u = tolower($(NF - 1)); ghz = u == "ghz" ? v : u == "mhz" ? v / 1e3 : -1 }
    name && /^    Compute \(SM\) Throughput / { sm = num($NF) }
    name && /^    Elapsed Cycles / { elapsed = num($NF) }
    name && /^    SM Active Cycles / { sm_active = num($NF) }
    name && /^    DRAM Throughput / { dram = num($NF) }
    name && /^    L2 Cache Throughput / { l2 = num($NF) }
    END {
        flush()
        if (labels && labels != n)
            printf "ncu-kernels.sh: %s: %d kernel records but %d launch lines; the what column is unreliable\n", report, n, labels > "/dev/stderr"
        if (!n) { printf "ncu-kernels.sh: %s: no kernel records in the report\n", report > "/dev/stderr"; exit 1 }
    }' report="$1" "$1"
}

header() {
    echo "| # | kernel | what | grid | ms | SM GHz | SM busiest % | SMs active % | DRAM % | L2 % |"
    echo "|---:|---|---|---|---:|---:|---:|---:|---:|---:|"
}

if [ "${1:-}" = "--table" ]; then
    [ -r "${2:-}" ] || { echo "ncu-kernels.sh: --table needs a readable ncu text report, got '${2:-}'" >&2; exit 2; }
    rows=$(ncu_table "$2") || exit 1 # the header only above rows: an error stays one line
    header
    echo "$rows"
    exit
fi

BUILD=${1:-build}
NCU_ARGS=()
for s in ${NCU_SECTIONS:-SpeedOfLight}; do NCU_ARGS+=(--section "$s"); done
[[ " ${NCU_SECTIONS:-SpeedOfLight} " == *" SpeedOfLight "* ]] || NCU_ARGS+=(--section SpeedOfLight)
case ${NCU_CLOCK:-base} in
    base | none) NCU_ARGS+=(--clock-control "${NCU_CLOCK:-base}") ;;
    *) echo "ncu-kernels.sh: NCU_CLOCK must be base or none, got '$NCU_CLOCK'" >&2; exit 2 ;;
esac
NCU=${NCU:-$(command -v ncu || echo /usr/local/cuda/bin/ncu)}
[ -x "$NCU" ] || { echo "ncu-kernels.sh: no Nsight Compute at '$NCU' (set NCU=/path/to/ncu)" >&2; exit 1; }
for t in bench_grouped_gemm bench_attention; do
    [ -x "$BUILD/tools/$t" ] || { echo "ncu-kernels.sh: $BUILD/tools/$t is missing (make $BUILD/tools/$t)" >&2; exit 1; }
done
OUT=${NCU_OUT:-$(mktemp -d /tmp/ncu-kernels.XXXXXX)}
mkdir -p "$OUT"

# profile NAME REGEX TOOL: one ncu run of TOOL's profile mode (argument 0) into OUT/NAME.txt
profile() {
    echo "ncu-kernels.sh: $3 0 under ncu (kernels matching $2) ..." >&2
    if ! "$NCU" -k "regex:$2" "${NCU_ARGS[@]}" "$BUILD/tools/$3" 0 > "$OUT/$1.txt" 2>&1; then
        echo "ncu-kernels.sh: ncu on $3 failed; the last lines of $OUT/$1.txt:" >&2
        tail -5 "$OUT/$1.txt" >&2
        exit 1
    fi
}
profile grouped grouped_gemm_kernel bench_grouped_gemm
profile attention tc_ bench_attention
grouped=$(ncu_table "$OUT/grouped.txt") || exit 1
attention=$(ncu_table "$OUT/attention.txt") || exit 1
header
echo "$grouped"
echo "$attention"
echo "raw reports: $OUT" >&2
