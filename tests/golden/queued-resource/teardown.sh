#!/usr/bin/env bash
# Rendered by `xla-shard gcp render --target queued-resource` from config.yaml. Re-render rather than edit.
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

# Deletes what the deploy script created. Checkpoints in the bucket stay.
run "$GCLOUD" compute tpus queued-resources delete xla-shard-v4 --zone=us-central2-b --project=my-project --force --quiet
