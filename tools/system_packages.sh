#!/usr/bin/env bash
# The Debian/Ubuntu packages bert_ds's environment needs, installed only when missing (`make venv` runs this first):
#   python3-venv, python3-dev   the virtual environment and headers for extensions built from source
#   g++                         DeepSpeed JIT-compiles its CPU shared-memory comm extension (deepspeed_shm_comm)
#   libopenmpi-dev, openmpi-bin mpi4py and `mpirun -np N`
#   time                        /usr/bin/time -v in docs/data.md's commands (run by tests/test_doc_commands.py)
#   openssl                     the self-signed certificate of the https shard store tests/data/remote starts
# As root it calls apt-get directly (there may be no sudo); as a user through sudo. Elsewhere it names what is missing.
set -euo pipefail
packages=(python3-venv python3-dev g++ libopenmpi-dev openmpi-bin time openssl)
if ! command -v dpkg-query >/dev/null 2>&1; then
    echo "system_packages.sh: not a Debian/Ubuntu system; make sure these (or their equivalents) are installed:" \
         "${packages[*]}" >&2
    exit 0
fi
missing=()
for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null 2>&1 || { echo "system_packages.sh: missing ${missing[*]}, and no sudo to install" \
        "them: ask an administrator to run: apt-get install ${missing[*]}" >&2; exit 1; }
    SUDO="sudo"
fi
echo "installing the Debian packages bert_ds needs: ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
$SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
