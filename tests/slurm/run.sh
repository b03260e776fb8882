#!/usr/bin/env bash
# `make test-slurm`: the Slurm path under a real (local, one-node) Slurm. Submits
# scripts/launch-slurm.sh with configs/tiny.yaml on 2 CPU tasks and checks:
#   a. the dry run prints the same layout (mesh, model, batch) as the training after it, --set included
#   b. scontrol requeue -> checkpoint, requeued, resumes there, same losses as an uninterrupted run
#   c. scancel --signal=USR1 --batch (the time-limit warning) -> checkpoint, clean exit, requeued, same losses
#   d. kill -9 of one task -> the job ends non-zero within the watchdog time, a line names the rank
#   e. SIGSTOP of one task -> the watchdog fires, names the stopped rank, the job ends non-zero
# Starts the local Slurm with ../shared/slurm/local-slurm.sh (needs root and apt-get when Slurm is
# not installed yet); where the machine cannot, it prints SKIPPED and exits 0.
set -uo pipefail
cd "$(dirname "$0")/../.."
root=$PWD
BUILD=${BUILD:-build}
# enough steps that a signal sent after step 20 lands mid-run: the tiny model takes ~25 ms a step
# on 2 idle cores, and at 80 steps a USR1 once arrived after the last step
STEPS=${STEPS:-400}
WATCHDOG_S=${WATCHDOG_S:-10}
pass=0 fail=0
ok() { echo "PASS: $*"; pass=$((pass + 1)); }
bad() { echo "FAIL: $*"; fail=$((fail + 1)); }
# the jobs' directory stays for a look when something failed
finish() {
    echo "test-slurm: $pass passed, $fail failed"
    [ "$fail" = 0 ] && [ -n "${work:-}" ] && rm -rf "$work"
    [ "$fail" = 0 ]
    exit $?
}
skip() { echo "test-slurm: SKIPPED, nothing was tested: $*"; exit 0; }

[ -x "$BUILD/moetrain" ] || { bad "$BUILD/moetrain is not built"; finish; }
setup=../shared/slurm/local-slurm.sh
if [ "$(id -u)" = 0 ]; then
    [ -f "$setup" ] || skip "$setup is missing (the shared directory beside the checkout)"
    command -v slurmctld >/dev/null || command -v apt-get >/dev/null ||
        skip "Slurm is not installed and there is no apt-get to install it"
    # never rewrite the configuration of a real cluster's machine
    if [ -f /etc/slurm/slurm.conf ] && ! grep -qx "ClusterName=local" /etc/slurm/slurm.conf; then
        skip "/etc/slurm/slurm.conf belongs to another Slurm (not written by $setup); not touching it"
    fi
    echo "test-slurm: starting the local Slurm ($setup)"
    bash "$setup" || { bad "the local Slurm did not start"; finish; }
elif sinfo -h -o %T 2>/dev/null | grep -qx idle; then
    echo "test-slurm: not root: using the Slurm that is already up"
else
    skip "starting a local Slurm needs root, and none is up"
fi

work=$(mktemp -d /tmp/moetrain-test-slurm.XXXXXX)
echo "test-slurm: jobs write to $work"
# a lighter step than tiny.yaml's (one micro-step of 4 x 32 tokens per rank): the machine may be shared
COMMON=(--set "train.steps=$STEPS" --set log.interval=10 --set parallel.expert_parallel_size=2
    --set train.global_batch_size=8 --set train.seq_len=32)

# submit NAME [moetrain options...]: the launch script as a user submits it, on the CPU partition
submit() {
    local name=$1
    shift
    # yield_when_idle: 2 ranks on 2 shared cores must not spin against each other
    CONFIG="$root/configs/tiny.yaml" MOETRAIN="$root/$BUILD/moetrain" OMPI_MCA_mpi_yield_when_idle=1 \
        sbatch --parsable --chdir="$work" --job-name="$name" --nodes=1 --ntasks-per-node=2 \
        --gpus-per-node=0 --cpus-per-task=1 --time=10 "$root/scripts/launch-slurm.sh" "${COMMON[@]}" "$@"
}
field() { scontrol show job "$1" 2>/dev/null | grep -o "$2=[^ ]*" | head -1 | cut -d= -f2; }
log_of() { cat "$work/$1-$2.out" "$work/$1-$2.err" 2>/dev/null; }

# Waits until job $1 has ended (at most $2 s); a requeued job's start delay is cut short.
# Prints the final state and exit code ("COMPLETED 0:0").
wait_end() {
    local id=$1 t_end=$((SECONDS + $2)) st
    while [ $SECONDS -lt $t_end ]; do
        st=$(field "$id" JobState)
        case "$st" in
        COMPLETED | FAILED | CANCELLED | TIMEOUT | NODE_FAIL | OUT_OF_MEMORY | BOOT_FAIL | DEADLINE)
            echo "$st $(field "$id" ExitCode)"; return ;;
        PENDING) [ "$(field "$id" Reason)" = BeginTime ] && scontrol update jobid="$id" starttime=now 2>/dev/null ;;
        esac
        sleep 1
    done
    echo "STILL-${st:-UNKNOWN}"
}
# Waits until metrics file $1 holds at least $2 steps (at most $3 s).
wait_steps() {
    local t_end=$((SECONDS + $3))
    while [ $SECONDS -lt $t_end ]; do
        [ -f "$1" ] && [ "$(wc -l < "$1")" -ge "$2" ] && return 0
        sleep 0.5
    done
    return 1
}
# the step and its loss, CE, aux loss and grad norm from each JSONL record, by key (the order and the
# other keys of a record are not this test's business), in step order
losses() {
    awk '{ out = ""; n = split("step loss ce_loss aux_loss grad_norm", key, " ")
           for (i = 1; i <= n; i++) {
               v = "missing"
               if (match($0, "\"" key[i] "\": [^,}]*")) { v = substr($0, RSTART, RLENGTH); sub(/^[^:]*: /, "", v) }
               out = out (i > 1 ? " " : "") v
           }
           print out }' "$1" | sort -n
}

# --- a: the uninterrupted reference run; its dry run and its training print the same layout
ref=$(submit ref --set log.metrics="$work/ref.jsonl" --set checkpoint.dir="$work/ck-ref") || { bad "sbatch refused the launch script"; finish; }
end=$(wait_end "$ref" 300)
if [ "$end" = "COMPLETED 0:0" ]; then ok "a: the launch script runs to completion under sbatch ($end)"
else bad "a: reference job $ref ended $end"; log_of ref "$ref" | tail -20; fi
log_of ref "$ref" | sed -n '/^launch-slurm: dry run/,/^launch-slurm: training/p' | sed '1d;$d' > "$work/dry.txt"
# the training prints the same layout after its resume line, then its start-up lines
log_of ref "$ref" | sed -n '/^launch-slurm: training/,/^moetrain train /p' | sed '1d;$d' |
    sed -n '/^moetrain layout:/,$p' > "$work/train.txt"
if [ -s "$work/dry.txt" ] && [ "$(head -1 "$work/dry.txt" | cut -d: -f1)" = "moetrain layout" ] && grep -q "ep 2 x ep_fsdp 1" "$work/dry.txt" && cmp -s "$work/dry.txt" "$work/train.txt"; then
    ok "a: the dry run prints the layout the training prints ($(wc -l < "$work/dry.txt") lines, --set applied: $(grep '^mesh:' "$work/dry.txt"))"
else
    bad "a: dry run and training layouts differ or lack the --set mesh (ep 2)"; diff "$work/dry.txt" "$work/train.txt" | head -10
fi

# b, c: stop mid-run, let the job be requeued, compare the resumed steps with the reference
stop_and_resume() {
    local tag=$1 what=$2 id end k
    id=$(submit "$tag" --set log.metrics="$work/$tag.jsonl" --set checkpoint.dir="$work/ck-$tag")
    if ! wait_steps "$work/$tag.jsonl" 20 180; then
        bad "$tag: job $id did not reach step 20"; log_of "$tag" "$id" | tail -20; return
    fi
    case $what in
    requeue) scontrol requeue "$id" ;;
    usr1) scancel --signal=USR1 --batch "$id" ;;
    esac
    end=$(wait_end "$id" 300)
    local log
    log=$(log_of "$tag" "$id")
    k=$(sed -nE 's/^preempted \((SIGTERM|SIGUSR1)\): stopped after step ([0-9]+); checkpoint saved in .*/\2/p' <<< "$log" | head -1)
    local sig=SIGTERM
    [ "$what" = usr1 ] && sig=SIGUSR1
    if [ -n "$k" ] && grep -q "^preempted ($sig): stopped after step $k; checkpoint saved in $work/ck-$tag/step_0*$k" <<< "$log" &&
        [ -f "$work/ck-$tag/step_$(printf %08d "$k")/COMPLETE" ]; then
        ok "$tag: $what -> the checkpoint of step $k was saved and its place printed"
    else
        bad "$tag: $what -> no 'preempted ($sig) ... checkpoint saved' line with a complete checkpoint"
        grep -E "preempt|launch-slurm|error" <<< "$log" | head -10
        return
    fi
    if [ "$what" = usr1 ]; then
        if grep -q "^launch-slurm: moetrain exited with 0" <<< "$log" && grep -q "^launch-slurm: requeued job $id" <<< "$log"; then
            ok "$tag: moetrain exited 0 after the save and the script requeued the job"
        else bad "$tag: no clean exit 0 followed by the script's requeue"; grep "^launch-slurm" <<< "$log"; fi
    fi
    if [ "$end" = "COMPLETED 0:0" ] && grep -q "^launch-slurm: job $id run 2 " <<< "$log" &&
        grep -q "resumed from $work/ck-$tag/step_0*$k (step $k)" <<< "$log"; then
        ok "$tag: requeued, the second run resumed from step $k and completed"
    else
        bad "$tag: expected a second run resuming from step $k and COMPLETED 0:0; got $end"
        grep -E "^launch-slurm|init|error" <<< "$log" | head -10
        return
    fi
    losses "$work/ref.jsonl" | awk -v k="$k" '$1 > k' > "$work/$tag.ref"
    losses "$work/$tag.jsonl" | awk -v k="$k" '$1 > k' > "$work/$tag.got"
    local n
    n=$(wc -l < "$work/$tag.ref")
    if [ "$n" = $((STEPS - k)) ] && cmp -s "$work/$tag.ref" "$work/$tag.got"; then
        ok "$tag: steps $((k + 1))-$STEPS after the resume have the uninterrupted run's loss, CE, aux and grad norm (all $n, as printed to 8 digits)"
    else
        bad "$tag: the resumed steps differ from the uninterrupted run"; diff "$work/$tag.ref" "$work/$tag.got" | head -6
    fi
}
stop_and_resume requeue requeue
stop_and_resume usr1 usr1

# d, e: one task dies (kill -9) or stops (SIGSTOP): the job must end non-zero within the watchdog
# time and a line must name that rank
broken_rank() {
    local tag=$1 sig=$2 id t0 end took log
    id=$(submit "$tag" --set train.steps=100000 --set log.metrics="$work/$tag.jsonl" \
        --set checkpoint.dir="$work/ck-$tag" --set train.watchdog_s="$WATCHDOG_S")
    local hb="$work/ck-$tag/.heartbeat/rank_00001"
    if ! wait_steps "$work/$tag.jsonl" 10 180 || [ ! -f "$hb" ]; then
        bad "$tag: job $id did not reach step 10 with a heartbeat file"; scancel "$id"; return
    fi
    local pid
    pid=$(cut -f2 "$hb")
    t0=$SECONDS
    kill -"$sig" "$pid"
    end=$(wait_end "$id" $((WATCHDOG_S + 60)))
    took=$((SECONDS - t0))
    log=$(log_of "$tag" "$id")
    local limit=$((WATCHDOG_S + 15))
    if [ "${end%% *}" = FAILED ] && [ "$took" -le "$limit" ]; then
        ok "$tag: kill -$sig of rank 1 -> the job ended $end after $took s (watchdog $WATCHDOG_S s, limit $limit s)"
    else
        bad "$tag: kill -$sig of rank 1 -> job ended '$end' after $took s (want FAILED within $limit s)"
        [ "${end%% *}" = FAILED ] || scancel "$id"
    fi
    local named
    if [ "$sig" = 9 ]; then
        # srun's own line, or the watchdog's when srun's SIGTERM to the survivor could not end it
        named=$(grep -E "watchdog: .*late: .*rank 1 dead" <<< "$log" | head -1)
        [ -n "$named" ] || named=$(grep -E "task 1: Killed" <<< "$log" | head -1)
    else
        named=$(grep -E "watchdog: .*late: .*rank 1 stopped" <<< "$log" | head -1)
    fi
    if [ -n "$named" ]; then ok "$tag: a line names rank 1: $named"
    else bad "$tag: no line names rank 1"; tail -8 <<< "$log"; fi
}
broken_rank kill9 9
broken_rank sigstop STOP

finish
