#!/usr/bin/env bash
# A/B of two environments (or two builds, below): short trains, alternating A, B, A, B, ... so that a
# card's drift hits both sides alike. For switches that keep the bits (MT_ATTN_BWD_RECOMPUTE=1,
# MT_NO_DEFERRED_WGRAD=1, ...): it says whether every run printed the same losses.
#   scripts/ab-train.sh "A_VAR=1 ..." "B_VAR=1 ..."     ("" = the default environment)
# A third and fourth environment (C, D) join the same alternation, each compared with A: one job
# for what would be two A/Bs against the same A.
# AB_CONFIG (configs/bench-qwen3-30b-8l.yaml), AB_STEPS (8), AB_ROUNDS (2), AB_NP (1 rank per GPU;
# > 1 runs under mpirun), AB_SET (more arguments, e.g. "--set model.num_hidden_layers=4"),
# AB_SET_A .. AB_SET_D: more arguments for one side only (e.g. AB_SET_B="--set
# parallel.expert_wgrad_group=4": a config setting against its default).
# AB_OUT (build/ab), BUILD (build). Step time: the median of steps 3 onwards of each run.
# AB_BUILD_A / AB_BUILD_B: a build directory for one side instead of BUILD, to A/B two commits on
# the same card (a card's clock at the power cap moves the step by a few %, more than most changes):
#   git archive -o old.tar REV && mkdir -p old && tar -xf old.tar -C old && make -C old build/moetrain
#   AB_BUILD_A=old/build scripts/ab-train.sh "" ""
set -uo pipefail
[ $# -ge 2 ] && [ $# -le 4 ] || { echo "usage: scripts/ab-train.sh \"A env\" \"B env\" [\"C env\" [\"D env\"]]" >&2; exit 2; }
BUILD=${BUILD:-build}
CONFIG=${AB_CONFIG:-configs/bench-qwen3-30b-8l.yaml}
STEPS=${AB_STEPS:-8}
ROUNDS=${AB_ROUNDS:-2}
NP=${AB_NP:-1}
OUT=${AB_OUT:-$BUILD/ab}
mkdir -p "$OUT"
envs=("$@")
names=(A B C D)
builds=("${AB_BUILD_A:-$BUILD}" "${AB_BUILD_B:-$BUILD}" "$BUILD" "$BUILD")
side_sets=("${AB_SET_A:-}" "${AB_SET_B:-}" "${AB_SET_C:-}" "${AB_SET_D:-}")
for b in "${builds[@]}"; do
    [ -x "$b/moetrain" ] || { echo "ab: no $b/moetrain (build it first)" >&2; exit 2; }
done
launch=()
[ "$NP" -gt 1 ] && launch=(mpirun --oversubscribe --bind-to none -np "$NP")
# one card picked by CUDA_VISIBLE_DEVICES (two A/Bs at once, one per card): sample only that card
smi_gpu=()
[[ "${CUDA_VISIBLE_DEVICES:-}" =~ ^[0-9]+$ ]] && smi_gpu=(-i "$CUDA_VISIBLE_DEVICES")
failed=0
for r in $(seq 1 "$ROUNDS"); do
    for side in $(seq 0 $(( $# - 1 ))); do
        tag="$OUT/${names[$side]}_$r"
        rm -f "$tag.jsonl"
        nvidia-smi ${smi_gpu[@]+"${smi_gpu[@]}"} --query-gpu=memory.used,power.draw,clocks.sm \
            --format=csv,noheader,nounits -lms 250 > "$tag.smi" 2>/dev/null &
        smi=$!
        # shellcheck disable=SC2086 # the environment is a list of words on purpose
        env ${envs[$side]} "${launch[@]}" "${builds[$side]}/moetrain" train "$CONFIG" --set train.steps="$STEPS" \
            --set log.metrics="$tag.jsonl" ${AB_SET:-} ${side_sets[$side]} > "$tag.log" 2>&1
        rc=$?
        kill $smi 2>/dev/null; wait $smi 2>/dev/null
        if [ $rc -ne 0 ]; then echo "ab: ${tag##*/} failed (rc $rc), see $tag.log"; failed=1; fi
    done
done
label() {  # a side's environment and arguments, and its build where the sides' builds differ
    local l="$1${side_sets[$2]:+ ${side_sets[$2]}}"
    l="${l# }"
    [ "${builds[0]}" = "${builds[1]}" ] || l="${l:+$l }[${builds[$2]}]"
    echo "$l"
}
labels=()
for side in $(seq 0 $(( $# - 1 ))); do labels+=("$(label "${envs[$side]}" "$side")"); done
python3 - "$OUT" "$ROUNDS" "${labels[@]}" <<'PY'
import json, statistics, sys
out, rounds, envs = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
sides = "ABCD"[:len(envs)]
def run(tag):
    try:
        rows = [json.loads(l) for l in open(f"{out}/{tag}.jsonl")]
    except OSError:
        return None
    steady = rows[2:] or rows
    mem, mhz = 0.0, []
    try:
        for line in open(f"{out}/{tag}.smi"):
            f = [x.strip() for x in line.split(",")]
            try:
                mem = max(mem, float(f[0]) / 1024)
                mhz.append((float(f[1]), float(f[2])))
            except (ValueError, IndexError):
                pass
    except OSError:
        pass
    busy = [m for w, m in mhz if mhz and w >= 0.5 * max(w for w, _ in mhz)]
    return {"ms": statistics.median(r["step_ms"] for r in steady), "losses": [r["loss"] for r in rows],
            "mem": mem, "mhz": statistics.median(busy) if busy else None}
res = {s: [run(f"{s}_{r}") for r in range(1, rounds + 1)] for s in sides}
print(f"{'run':<6}{'step ms':>10}{'peak GiB':>10}{'SM MHz':>8}  env")
for s, env in zip(sides, envs):
    for r, x in enumerate(res[s], 1):
        if x is None:
            print(f"{s}_{r:<4}{'failed':>10}")
            continue
        mhz = f"{x['mhz']:.0f}" if x["mhz"] else "-"
        print(f"{s}_{r:<4}{x['ms']:>10.1f}{x['mem']:>10.1f}{mhz:>8}  {env or '(default)'}")
ok = [x for s in sides for x in res[s] if x]
med = {s: statistics.median(x["ms"] for x in res[s]) for s in sides if res[s] and all(res[s])}
if "A" in med and "B" in med:
    a, b = med["A"], med["B"]
    print(f"A {a:.1f} ms, B {b:.1f} ms: B is {100 * (b - a) / a:+.2f}% against A")
for s in sides[2:]:
    if "A" in med and s in med:
        print(f"{s} {med[s]:.1f} ms: {s} is {100 * (med[s] - med['A']) / med['A']:+.2f}% against A")
if ok:
    same = all(x["losses"] == ok[0]["losses"] for x in ok)
    # a switch that changes the bits on purpose: each side must still repeat its own
    within = rounds > 1 and all(len({tuple(x["losses"]) for x in res[s] if x}) == 1 for s in sides)
    print("losses: the same in every run" if same else
          "losses: DIFFER between runs" + ("; the same within " + " and within ".join(sides) if within else ""))
PY
exit $failed
