#!/usr/bin/env bash
# Rendered by `xla-shard gcp render --target gke` from config.yaml. Re-render rather than edit.
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
PLACEHOLDERS='deploy.project=my-project, checkpoint.dir=gs://my-bucket/xla-shard/small-llama, output_dir=gs://my-bucket/out still hold the example'"'"'s placeholders'
if [[ -n "$PLACEHOLDERS" ]]; then
  if [[ "$DRY_RUN" == 1 ]]; then
    echo "deploy: WARNING: $PLACEHOLDERS; the real run will refuse to start" >&2
  else
    echo "deploy: $PLACEHOLDERS: set your own and render again" >&2
    exit 2
  fi
fi

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
KUBECTL="${KUBECTL:-kubectl}"

# Deletes the JobSet (and its pods) and the config; checkpoints in the bucket stay.
run "$KUBECTL" delete --ignore-not-found --filename="$HERE"/jobset.yaml
