#!/usr/bin/env bash
# Rendered by `xla-shard gcp render --target gpu-vm` from config.yaml. Re-render rather than edit.
# DRY_RUN=1 prints every command instead of running it; GCLOUD picks the gcloud binary.
set -euo pipefail
GCLOUD="${GCLOUD:-gcloud}"
DRY_RUN="${DRY_RUN:-0}"

# Prints each command as a shell would re-read it (%q), then runs it unless DRY_RUN=1. Never evaluates text.
run() {
  printf '+' >&2
  printf ' %q' "$@" >&2
  printf '\n' >&2
  if [[ "$DRY_RUN" != 1 ]]; then "$@"; fi
}

# Values still set to the example configs' placeholders: a dry run flags them, a real run refuses to start.
PLACEHOLDERS='deploy.project=my-project, checkpoint.dir=gs://my-bucket/xla-shard/small-llama-gpu still hold the example'"'"'s placeholders'
if [[ -n "$PLACEHOLDERS" ]]; then
  if [[ "$DRY_RUN" == 1 ]]; then
    echo "deploy: WARNING: $PLACEHOLDERS; the real run will refuse to start" >&2
  else
    echo "deploy: $PLACEHOLDERS: set your own and render again" >&2
    exit 2
  fi
fi

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# The code at HEAD of the xla_shard checkout (REPO, default: the one this is run from) goes to every worker.
REPO="${REPO:-$(git rev-parse --show-toplevel 2>/dev/null || true)}"
if [[ -z "$REPO" && "$DRY_RUN" != 1 ]]; then
  echo "deploy.sh: run it from inside the xla_shard checkout, or set REPO=/path/to/xla_shard" >&2
  exit 2
elif [[ -z "$REPO" ]]; then
  echo "deploy.sh: WARNING: not inside an xla_shard checkout; the real run will need REPO=/path/to/xla_shard" >&2
fi
run git -C "${REPO:-.}" archive --format=tar.gz -o "$HERE/xla_shard.tar.gz" HEAD

run "$GCLOUD" compute instances create xla-shard-a3 --zone=us-central1-a --project=my-project --machine-type=a3-highgpu-8g --image-family=common-cu128-ubuntu-2204-nvidia-570 --image-project=deeplearning-platform-release --boot-disk-size=200GB --maintenance-policy=TERMINATE --provisioning-model=SPOT --instance-termination-action=STOP --scopes=https://www.googleapis.com/auth/cloud-platform --metadata-from-file=startup-script="$HERE"/startup.sh
run "$GCLOUD" compute scp "$HERE"/xla_shard.tar.gz "$HERE"/config.yaml 'xlashard@xla-shard-a3:~/' --zone=us-central1-a --project=my-project
run "$GCLOUD" compute ssh xlashard@xla-shard-a3 --zone=us-central1-a --project=my-project '--command=mkdir -p ~/xla_shard && tar xzf ~/xla_shard.tar.gz -C ~/xla_shard && bash ~/xla_shard/scripts/setup_worker.sh gpu'
run "$GCLOUD" compute ssh xlashard@xla-shard-a3 --zone=us-central1-a --project=my-project '--command=cd ~/xla_shard && setsid nohup scripts/train_loop.sh ~/config.yaml > ~/train.log 2>&1 < /dev/null &'
if [[ "$DRY_RUN" == 1 ]]; then
  echo 'DRY_RUN=1: the commands above were printed, not run; nothing was created or started for xla-shard-a3' >&2
else
  echo 'training started on xla-shard-a3; follow the log with:' >&2
  echo '  gcloud compute ssh xlashard@xla-shard-a3 --zone=us-central1-a --project=my-project '"'"'--command=tail -F ~/train.log'"'"'' >&2
fi
