#!/usr/bin/env bash
# Preemption and watchdog on whatever backend `auto` picks here (on a GPU machine: CUDA + NCCL,
# where the watchdog must ncclCommAbort a communicator stuck on a stopped peer):
#   scripts/check-signals.sh [BUILD] [NP]      (default build, 2 ranks)
# 1. SIGTERM to every rank mid-run: a checkpoint of that step, "preempted (SIGTERM)", exit 0.
# 2. SIGSTOP of one rank with train.watchdog_s=10: the other ranks' watchdog names it and the job
#    ends non-zero within about 15 s.
set -uo pipefail
BUILD=${1:-build}
NP=${2:-2}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_mpi_yield_when_idle=1
work=$(mktemp -d /tmp/moetrain-signals.XXXXXX)
fail=0
run() { # tag, extra options: starts the run, waits for 5 steps, prints the rank pids
    timeout 300 mpirun --oversubscribe -np "$NP" "$BUILD/moetrain" train configs/tiny.yaml \
        --set train.steps=1000000 --set log.interval=1000 --set log.metrics="$work/$1.jsonl" \
        --set checkpoint.dir="$work/ck-$1" "${@:2}" > "$work/$1.log" 2>&1 &
    mp=$!
    for _ in $(seq 1200); do
        [ -f "$work/$1.jsonl" ] && [ "$(wc -l < "$work/$1.jsonl")" -ge 5 ] && break
        sleep 0.1
    done
}
run term
kill -TERM $(cut -f2 "$work"/ck-term/.heartbeat/rank_*)
wait $mp
rc=$?
if [ $rc = 0 ] && grep -q "^preempted (SIGTERM): stopped after step [0-9]*; checkpoint saved in" "$work/term.log"; then
    echo "PASS: SIGTERM -> $(grep '^preempted' "$work/term.log")"
else echo "FAIL: SIGTERM -> exit $rc"; tail -5 "$work/term.log"; fail=1; fi

run stop --set train.watchdog_s=10
t0=$SECONDS
kill -STOP "$(cut -f2 "$work/ck-stop/.heartbeat/rank_00001")"
wait $mp
rc=$?
took=$((SECONDS - t0))
if [ $rc != 0 ] && [ $rc != 124 ] && [ $took -le 25 ] && grep -q "watchdog: .*late: .*rank 1 stopped" "$work/stop.log"; then
    echo "PASS: SIGSTOP of rank 1 -> exit $rc after $took s: $(grep -m1 'watchdog: no progress' "$work/stop.log")"
else echo "FAIL: SIGSTOP of rank 1 -> exit $rc after $took s"; tail -5 "$work/stop.log"; fail=1; fi
rm -rf "$work"
exit $fail
