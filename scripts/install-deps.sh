#!/usr/bin/env bash
# Installs the Debian/Ubuntu packages moetrain builds and tests with, skipping what is present.
set -euo pipefail
pkgs=(build-essential pkg-config openmpi-bin libopenmpi-dev libyaml-dev libjansson-dev
      libhdf5-dev libcriterion-dev)
missing=()
for p in "${pkgs[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
echo "moetrain: installing missing packages: ${missing[*]}"
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
