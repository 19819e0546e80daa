#!/usr/bin/env bash
# Set up one machine to run xla_shard: a virtualenv with the package as pyproject.toml pins it.
#   scripts/setup_worker.sh tpu        # torch 2.9 + torch_xla[tpu] (libtpu), on every worker of a Cloud TPU VM
#   scripts/setup_worker.sh torchtpu   # TorchTPU (torch_tpu, libtpu) on the newest torch it supports, likewise
#   scripts/setup_worker.sh gpu        # the newest torch (CUDA), on a GPU VM
# Run from the unpacked repository. DRY_RUN=1 prints the commands instead. VENV picks the virtualenv path.
set -euo pipefail
kind="${1:?usage: setup_worker.sh tpu|torchtpu|gpu}"
DRY_RUN="${DRY_RUN:-0}"
VENV="${VENV:-$HOME/venv}"
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

run() {
  printf '+ %s\n' "$*" >&2
  if [[ "$DRY_RUN" != 1 ]]; then "$@"; fi
}

case "$kind" in
  tpu) extra="[tpu]" ;;
  torchtpu) extra="[torchtpu]" ;;
  gpu) extra="" ;;
  *) echo "setup_worker.sh: unknown kind '$kind' (tpu, torchtpu or gpu)" >&2; exit 2 ;;
esac

run python3 -m venv "$VENV"
run "$VENV/bin/pip" install --quiet --upgrade pip
# torch_xla[tpu] pulls libtpu from Google's index; the pins themselves live in pyproject.toml only.
run "$VENV/bin/pip" install --quiet -e "$repo$extra" -f https://storage.googleapis.com/libtpu-releases/index.html
run "$VENV/bin/xla-shard" --help > /dev/null
echo "xla_shard ready in $VENV" >&2
