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

# The image jobset.yaml names (deploy.image) must hold xla_shard and its runtime; the config travels in
# jobset.yaml too, as a ConfigMap.
echo 'xla-shard-v4: deploy.provisioning spot: the pods wait for a spot node pool (cloud.google.com/gke-spot=true); set on-demand for others' >&2
echo 'xla-shard-v4: pods run as Kubernetes service account xla-shard-v4, bound to trainer@acme-train-1.iam.gserviceaccount.com through Workload Identity (bind_service_account.sh, once)' >&2
echo 'xla-shard-v4: submitted to Kueue queue team-a-tpu at priority high' >&2
run "$GCLOUD" container clusters get-credentials shared --region=us-east5 --project=my-project
run "$KUBECTL" delete jobset xla-shard-v4 --namespace=team-a --ignore-not-found --wait=true
run "$KUBECTL" apply --filename="$HERE"/jobset.yaml
if [[ "$DRY_RUN" == 1 ]]; then
  echo 'DRY_RUN=1: the commands above were printed, not run; nothing was created or started for xla-shard-v4' >&2
else
  echo 'training started on xla-shard-v4; follow the log with:' >&2
  echo '  kubectl logs --follow --namespace=team-a --max-log-requests=64 --selector=jobset.sigs.k8s.io/jobset-name=xla-shard-v4' >&2
fi
