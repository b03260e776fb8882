#!/usr/bin/env bash
# `make run`: trains CONFIG on whatever this machine has.
#   GPUs visible -> one rank per GPU, experts split across them (EP = number of GPUs);
#   no GPU       -> NP CPU ranks (default 4) as EP=2 x EP_FSDP=2.
# Extra arguments after the first three go to moetrain (e.g. --set train.steps=50).
set -euo pipefail
bin=$1 config=$2 np=$3
shift 3
ngpu=0
if command -v nvidia-smi >/dev/null 2>&1; then
    ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
fi
if [ "$ngpu" -gt 0 ]; then
    np=$ngpu
    ep=$ngpu
    echo "make run: $ngpu GPU(s) found: $np rank(s), expert_parallel_size $ep"
else
    ep=2
    [ "$np" -lt 2 ] && ep=1
    echo "make run: no GPU: $np CPU rank(s), expert_parallel_size $ep"
fi
exec mpirun --oversubscribe --bind-to none -np "$np" "$bin" train "$config" \
    --set parallel.expert_parallel_size="$ep" "$@"
