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

XPK="${XPK:-xpk}"

echo 'xpk.sh: xpk runs the pods as namespace team-a'"'"'s default Kubernetes service account, not xla-shard-v4: bind that one to trainer@acme-train-1.iam.gserviceaccount.com, or use deploy.sh' >&2
echo 'xpk.sh: xpk submits to its own Kueue queue, not team-a-tpu' >&2
echo 'xpk.sh: xpk sets the pods'"'"' CPU and memory requests itself; deploy.cpu and deploy.memory are not passed' >&2
# The same workload as jobset.yaml, created by xpk (its cluster set up by `xpk cluster create`); the config
# travels in the pods' environment, base64-encoded. A $NAME in --command is the pod's to expand, not this
# script's:
# shellcheck disable=SC2016
run "$XPK" workload create --workload=xla-shard-v4 --cluster=shared --project=my-project --zone=us-east5-b --namespace=team-a --tpu-type=v6e-16 --num-slices=1 --docker-image=us-docker.pkg.dev/p1/xla-shard:1 --max-restarts=5 --priority=high --env=XLA_SHARD_CONFIG_0=YmFja2VuZDogeGxhX3NwbWQKbWV0aG9kOiBzZnQKY3B1X2RldmljZXM6IDQKbW9kZWw6CiAgbmFtZTogc21hbGwtbGxhbWEKICBpbml0OiBhdXRvCiAgdGFzazogY2F1c2FsX2xtCiAgbnVtX2xhYmVsczogbnVsbAogIG92ZXJyaWRlczoge30KICBhdHRuX2ltcGxlbWVudGF0aW9uOiBhdXRvCiAgbG9yYTogbnVsbAogIHF1YW50aXphdGlvbjogbnVsbApmc2RwOgogIHNoYXJkaW5nX3N0cmF0ZWd5OiBGVUxMX1NIQVJECiAgc2hhcmRpbmc6IG51bGwKICBhdXRvX3dyYXBfcG9saWN5OiBUUkFOU0ZPUk1FUl9CQVNFRF9XUkFQCiAgdHJhbnNmb3JtZXJfbGF5ZXJfY2xzX3RvX3dyYXA6IFtdCiAgbWluX251bV9wYXJhbXM6IDEwMDAwMDAwMAogIGFjdGl2YXRpb25fY2hlY2twb2ludGluZzogdHJ1ZQogIHNjYW5fbGF5ZXJzOiBmYWxzZQogIG9mZmxvYWRfcGFyYW1zOiBmYWxzZQogIG1peGVkX3ByZWNpc2lvbjogJ25vJwogIGFjdGl2YXRpb25fZHR5cGU6IG51bGwKICBzdGF0ZV9kaWN0X3R5cGU6IFNIQVJERURfU1RBVEVfRElDVAogIGJ1Y2tldF9jYXBfbWI6IDI1LjAKICB4bGFfc2V0dGluZ3M6IHt9Cm1lc2g6CiAgZnNkcDogLTEKICByZXBsaWNhOiAxCiAgY29udGV4dDogMQogIGdlbmVyYXRpb246IGF1dG8KdHJhaW46CiAgc3RlcHM6IDIwMAogIGVwb2NoczogbnVsbAogIGdsb2JhbF9iYXRjaF9zaXplOiAzMgogIHNlcV9sZW46IDI1NgogIG9wdGltaXplcjogYWRhbXcKICBscjogMC4wMDEKICBscl9zY2hlZHVsZTogY29uc3RhbnQKICBscl93YXJtdXBfc3RlcHM6IDAKICBscl9taW5fcmF0aW86IDAuMAogIHdlaWdodF9kZWNheTogMC4wCiAgbWF4X2dyYWRfbm9ybTogbnVsbAogIGdyYWRfYWNjdW1fc3RlcHM6IDEKICBsb3NzX2NodW5rczogYXV0bwogIGNvbXBpbGU6IGZhbHNlCiAgc2VlZDogMAogIGxvZ19ldmVyeTogMQogIGV2YWxfZXZlcnk6IG51bGwKICBldmFsX3N0ZXBzOiBudWxsCiAgdGVuc29yYm9hcmQ6IGZhbHNlCiAgcGVha19mbG9wc19wZXJfZGV2aWNlOiBudWxsCiAgcmVjb21waWxlX3dhcm11cF9zdGVwczogMgpkYXRhOgogIHBhdGg6IHN5bnRoZXRpYwogIGZvcm1hdDogbnVsbAogIHRva2VuaXplcjogbnVsbAogIGtpbmQ6IHRleHQKICB0ZXh0X2ZpZWxkOiB0ZXh0CiAgbWVzc2FnZXNfZmllbGQ6IG1lc3NhZ2VzCiAgcHJvbXB0X2ZpZWxkOiBwcm9tcHQKICBjb21wbGV0aW9uX2ZpZWxkOiBjb21wbGV0aW9uCiAgY2hvc2VuX2ZpZWxkOiBjaG9zZW4KICByZWplY3RlZF9maWVsZDogcmVqZWN0ZWQKICBjb21wbGV0aW9uX29ubHlfbG9zczogbnVsbAogIHRleHRfZmllbGRzOgogIC0gdGV4dAogIGxhYmVsX2ZpZWxkOiBsYWJlbAogIHBhY2tpbmc6IHRydWUKICBwYWNraW5nX3N0cmF0ZWd5OiBudWxsCiAgZXZhbF9wYXRoOiBudWxsCiAgZXZhbF9mcmFjdGlvbjogMC4wCiAgbnVtX3Byb2M6IG51bGwKICBzdHJlYW1pbmc6IGZhbHNlCiAgc2h1ZmZsZV9idWZmZXI6IDEwMDAwCmxhdW5jaDoKICBucHJvY19wZXJfbm9kZTogbnVsbAogIG5ub2RlczogMQogIG5vZGVfcmFuazogbnVsbAogIHJkenZfZW5kcG9pbnQ6IG51bGwKICByZHp2X2lkOiB4bGFfc2hhcmQKICB0aW1lb3V0X3M6IDYwMC4wCmNoZWNrcG9pbnQ6CiAgZGlyOiBnczovL215LWJ1Y2tldC94bGEtc2hhcmQvc21hbGwtbGxhbWEKICBldmVyeV9zdGVwczogNTAKICBrZWVwX2xhc3Q6IDIKICBrZWVwX2V2ZXJ5OiBudWxsCiAgYXN5bmM6IHRydWUKICByZXN1bWU6IGF1dG8KICBwcmVlbXB0aW9uX2dyYWNlX3M6IDEyMC4wCiAgcmV0cnlfZGVhZGxpbmVfczogMTIwLjAKICBjb21taXRfdGltZW91dF9zOiA2MDAuMApkZXBsb3k6CiAgcHJvamVjdDogbXktcHJvamVjdAogIHpvbmU6IHVzLWVhc3Q1LWIKICBuYW1lOiB4bGEtc2hhcmQtdjQKICBhY2NlbGVyYXRvcl90eXBlOiB2NmUtMTYKICBwcm92aXNpb25pbmc6IHNwb3QKICBuZXR3b3JrOiBudWxsCiAgc3VibmV0d29yazogbnVsbAogIHNlcnZpY2VfYWNjb3VudDogdHJhaW5lckBhY21lLXRyYWluLTEuaWFtLmdzZXJ2aWNlYWNjb3VudC5jb20KICB2YWxpZF91bnRpbDogNmgKICBhbGxvd191bmxpc3RlZF96b25lOiBmYWxzZQogIGdwdV9tYWNoaW5lX3R5cGU6IGEzLWhpZ2hncHUtOGcKICBncHVfbm9kZXM6IDEKICBncHVfaW1hZ2VfZmFtaWx5OiBjb21tb24tY3UxMjgtdWJ1bnR1LTIyMDQtbnZpZGlhLTU3MAogIGdwdV9pbWFnZV9wcm9qZWN0OiBkZWVwbGVhcm5pbmctcGxhdGZvcm0tcmVsZWFzZQogIHJlbW90ZV91c2VyOiB4bGFzaGFyZAogIHJlbW90ZV9kaXI6IHhsYV9zaGFyZAogIGNsdXN0ZXI6IHNoYXJlZAogIGltYWdlOiB1cy1kb2NrZXIucGtnLmRldi9wMS94bGEtc2hhcmQ6MQogIG5hbWVzcGFjZTogdGVhbS1hCiAgbnVtX3NsaWNlczogMQogIG1heF9yZXN0YXJ0czogNQogIHJlZ2lvbjogdXMtZWFzdDUKICBxdWV1ZTogdGVhbS1hLXRwdQogIHByaW9yaXR5X2NsYXNzOiBoaWdoCiAgY3B1OiAnMjAwJwogIG1lbW9yeTogNzAwR2kKb3V0cHV0X2RpcjogZ3M6Ly9teS1idWNrZXQvb3V0Cg== --restart-on-exit-codes=1 --termination-grace-period-seconds=150 --spot '--command=printf %s "$XLA_SHARD_CONFIG_0" | base64 -d > /tmp/config.yaml && PJRT_DEVICE=TPU MASTER_ADDR=xla-shard-v4-slice-job-0-0.xla-shard-v4 xla-shard train /tmp/config.yaml'
