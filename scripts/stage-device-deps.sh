#!/usr/bin/env bash
# For the lent GPU machine, which has CUDA, NCCL, Open MPI and HDF5 but reaches no package
# registry: stage libyaml, Criterion (via ../shared/device/stage-deps.sh) and jansson into .devdeps/.
# Run from the project root; then carry .devdeps and start the command with `source .devdeps/use.sh`.
set -euo pipefail
../shared/device/stage-deps.sh
cd .devdeps/debs
ls libjansson-dev_*.deb >/dev/null 2>&1 || apt-get download libjansson-dev libjansson4
