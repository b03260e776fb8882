#!/usr/bin/env bash
# Makes sure moetrain's build and test dependencies are usable, installing the missing Debian/Ubuntu
# packages (as root or through sudo). A library counts as present when the compiler can find it
# (pkg-config, headers), however it got there: a machine without a package registry can provide
# them some other way (e.g. unpacked .debs on PKG_CONFIG_PATH/CPATH) and needs no install.
set -euo pipefail
missing=()
have_pc() { pkg-config --exists "$1" 2>/dev/null; }
# a header the C compiler finds (CPATH and the HDF5 serial include dir count)
have_h() { printf '#include <%s>\n' "$1" | cc -E -x c - -I/usr/include/hdf5/serial >/dev/null 2>&1; }
command -v pkg-config >/dev/null 2>&1 || missing+=(pkg-config)
command -v cc >/dev/null 2>&1 && command -v make >/dev/null 2>&1 || missing+=(build-essential)
command -v mpicc >/dev/null 2>&1 && command -v mpirun >/dev/null 2>&1 || missing+=(openmpi-bin libopenmpi-dev)
have_pc yaml-0.1 || have_h yaml.h || missing+=(libyaml-dev)
have_pc jansson || have_h jansson.h || missing+=(libjansson-dev)
have_pc criterion || have_h criterion/criterion.h || missing+=(libcriterion-dev)
have_pc hdf5 || have_h hdf5.h || missing+=(libhdf5-dev)
# Python packages of the tools the tests run (tools/requirements.txt, pinned), from PyPI
if ! python3 -c "import numpy, safetensors, matplotlib, tokenizers, tensorboardX" >/dev/null 2>&1; then
    echo "moetrain: installing tools/requirements.txt (pip)"
    python3 -m pip install -q -r "$(dirname "$0")/../tools/requirements.txt"
fi
python3 -c "import ensurepip" >/dev/null 2>&1 || missing+=(python3-venv)
if [ ${#missing[@]} -gt 0 ]; then
    echo "moetrain: installing missing packages: ${missing[*]}"
    sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    export DEBIAN_FRONTEND=noninteractive
    $sudo apt-get update -qq
    $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
# --transformers (`make test`): also torch and transformers for the export round trip test, in their
# own environment (tools/requirements-transformers.txt); `make run` does not need them
[ "${1:-}" = --transformers ] || exit 0
ref="$(dirname "$0")/../.venv-ref"
if ! "$ref/bin/python" -c "import torch, transformers" >/dev/null 2>&1; then
    echo "moetrain: installing torch and transformers into .venv-ref (tools/requirements-transformers.txt, ~4.7 GB)"
    python3 -m venv "$ref"
    "$ref/bin/python" -m pip install -q -r "$(dirname "$0")/../tools/requirements-transformers.txt"
fi
