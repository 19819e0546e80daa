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
PLACEHOLDERS='deploy.project=my-project, checkpoint.dir=gs://my-bucket/xla-shard/small-llama-gpu, output_dir=gs://my-bucket/out still hold the example'"'"'s placeholders'
if [[ -n "$PLACEHOLDERS" ]]; then
  if [[ "$DRY_RUN" == 1 ]]; then
    echo "deploy: WARNING: $PLACEHOLDERS; the real run will refuse to start" >&2
  else
    echo "deploy: $PLACEHOLDERS: set your own and render again" >&2
    exit 2
  fi
fi

XPK="${XPK:-xpk}"


# The same workload as jobset.yaml, created by xpk (its cluster set up by `xpk cluster create`); the config
# travels in the pods' environment, base64-encoded. A $NAME in --command is the pod's to expand, not this
# script's:
# shellcheck disable=SC2016
run "$XPK" workload create --workload=xla-shard-a3 --cluster=gpu-cluster --project=my-project --zone=us-central1-a --namespace=default --device-type=h100-80gb-8 --num-nodes=2 --docker-image=us-docker.pkg.dev/p1/xla-shard:1 --max-restarts=5 --env=XLA_SHARD_CONFIG_0=YmFja2VuZDogdG9yY2hfZnNkcAptZXRob2Q6IHNmdApjcHVfZGV2aWNlczogNAptb2RlbDoKICBuYW1lOiBzbWFsbC1sbGFtYQogIGluaXQ6IGF1dG8KICB0YXNrOiBjYXVzYWxfbG0KICBudW1fbGFiZWxzOiBudWxsCiAgb3ZlcnJpZGVzOiB7fQogIGF0dG5faW1wbGVtZW50YXRpb246IGF1dG8KICBsb3JhOiBudWxsCiAgcXVhbnRpemF0aW9uOiBudWxsCmZzZHA6CiAgc2hhcmRpbmdfc3RyYXRlZ3k6IEZVTExfU0hBUkQKICBzaGFyZGluZzogbnVsbAogIGF1dG9fd3JhcF9wb2xpY3k6IFRSQU5TRk9STUVSX0JBU0VEX1dSQVAKICB0cmFuc2Zvcm1lcl9sYXllcl9jbHNfdG9fd3JhcDogW10KICBtaW5fbnVtX3BhcmFtczogMTAwMDAwMDAwCiAgYWN0aXZhdGlvbl9jaGVja3BvaW50aW5nOiB0cnVlCiAgc2Nhbl9sYXllcnM6IGZhbHNlCiAgb2ZmbG9hZF9wYXJhbXM6IGZhbHNlCiAgbWl4ZWRfcHJlY2lzaW9uOiBiZjE2CiAgYWN0aXZhdGlvbl9kdHlwZTogbnVsbAogIHN0YXRlX2RpY3RfdHlwZTogU0hBUkRFRF9TVEFURV9ESUNUCiAgYnVja2V0X2NhcF9tYjogMjUuMAogIHhsYV9zZXR0aW5nczoge30KbWVzaDoKICBmc2RwOiAtMQogIHJlcGxpY2E6IDEKICBjb250ZXh0OiAxCiAgZ2VuZXJhdGlvbjogYXV0bwp0cmFpbjoKICBzdGVwczogMjAwCiAgZXBvY2hzOiBudWxsCiAgZ2xvYmFsX2JhdGNoX3NpemU6IDMyCiAgc2VxX2xlbjogMjU2CiAgb3B0aW1pemVyOiBhZGFtdwogIGxyOiAwLjAwMQogIGxyX3NjaGVkdWxlOiBjb25zdGFudAogIGxyX3dhcm11cF9zdGVwczogMAogIGxyX21pbl9yYXRpbzogMC4wCiAgd2VpZ2h0X2RlY2F5OiAwLjAKICBtYXhfZ3JhZF9ub3JtOiBudWxsCiAgZ3JhZF9hY2N1bV9zdGVwczogMQogIGxvc3NfY2h1bmtzOiBhdXRvCiAgY29tcGlsZTogZmFsc2UKICBzZWVkOiAwCiAgbG9nX2V2ZXJ5OiAxCiAgZXZhbF9ldmVyeTogbnVsbAogIGV2YWxfc3RlcHM6IG51bGwKICB0ZW5zb3Jib2FyZDogZmFsc2UKICBwZWFrX2Zsb3BzX3Blcl9kZXZpY2U6IG51bGwKICByZWNvbXBpbGVfd2FybXVwX3N0ZXBzOiAyCmRhdGE6CiAgcGF0aDogc3ludGhldGljCiAgZm9ybWF0OiBudWxsCiAgdG9rZW5pemVyOiBudWxsCiAga2luZDogdGV4dAogIHRleHRfZmllbGQ6IHRleHQKICBtZXNzYWdlc19maWVsZDogbWVzc2FnZXMKICBwcm9tcHRfZmllbGQ6IHByb21wdAogIGNvbXBsZXRpb25fZmllbGQ6IGNvbXBsZXRpb24KICBjaG9zZW5fZmllbGQ6IGNob3NlbgogIHJlamVjdGVkX2ZpZWxkOiByZWplY3RlZAogIGNvbXBsZXRpb25fb25seV9sb3NzOiBudWxsCiAgdGV4dF9maWVsZHM6CiAgLSB0ZXh0CiAgbGFiZWxfZmllbGQ6IGxhYmVsCiAgcGFja2luZzogdHJ1ZQogIHBhY2tpbmdfc3RyYXRlZ3k6IG51bGwKICBldmFsX3BhdGg6IG51bGwKICBldmFsX2ZyYWN0aW9uOiAwLjAKICBudW1fcHJvYzogbnVsbAogIHN0cmVhbWluZzogZmFsc2UKICBzaHVmZmxlX2J1ZmZlcjogMTAwMDAKbGF1bmNoOgogIG5wcm9jX3Blcl9ub2RlOiBudWxsCiAgbm5vZGVzOiAxCiAgbm9kZV9yYW5rOiBudWxsCiAgcmR6dl9lbmRwb2ludDogbnVsbAogIHJkenZfaWQ6IHhsYV9zaGFyZAogIHRpbWVvdXRfczogNjAwLjAKY2hlY2twb2ludDoKICBkaXI6IGdzOi8vbXktYnVja2V0L3hsYS1zaGFyZC9zbWFsbC1sbGFtYS1ncHUKICBldmVyeV9zdGVwczogNTAKICBrZWVwX2xhc3Q6IDMKICBrZWVwX2V2ZXJ5OiBudWxsCiAgYXN5bmM6IHRydWUKICByZXN1bWU6IGF1dG8KICBwcmVlbXB0aW9uX2dyYWNlX3M6IDEyMC4wCiAgcmV0cnlfZGVhZGxpbmVfczogMTIwLjAKICBjb21taXRfdGltZW91dF9zOiA2MDAuMApkZXBsb3k6CiAgcHJvamVjdDogbXktcHJvamVjdAogIHpvbmU6IHVzLWNlbnRyYWwxLWEKICBuYW1lOiB4bGEtc2hhcmQtYTMKICBhY2NlbGVyYXRvcl90eXBlOiB2NC04CiAgcHJvdmlzaW9uaW5nOiBzcG90CiAgbmV0d29yazogbnVsbAogIHN1Ym5ldHdvcms6IG51bGwKICBzZXJ2aWNlX2FjY291bnQ6IG51bGwKICB2YWxpZF91bnRpbDogNmgKICBhbGxvd191bmxpc3RlZF96b25lOiBmYWxzZQogIGdwdV9tYWNoaW5lX3R5cGU6IGEzLWhpZ2hncHUtOGcKICBncHVfbm9kZXM6IDIKICBncHVfaW1hZ2VfZmFtaWx5OiBjb21tb24tY3UxMjgtdWJ1bnR1LTIyMDQtbnZpZGlhLTU3MAogIGdwdV9pbWFnZV9wcm9qZWN0OiBkZWVwbGVhcm5pbmctcGxhdGZvcm0tcmVsZWFzZQogIHJlbW90ZV91c2VyOiB4bGFzaGFyZAogIHJlbW90ZV9kaXI6IHhsYV9zaGFyZAogIGNsdXN0ZXI6IGdwdS1jbHVzdGVyCiAgaW1hZ2U6IHVzLWRvY2tlci5wa2cuZGV2L3AxL3hsYS1zaGFyZDoxCiAgbmFtZXNwYWNlOiBkZWZhdWx0CiAgbnVtX3NsaWNlczogMQogIG1heF9yZXN0YXJ0czogNQogIHJlZ2lvbjogbnVsbAogIHF1ZXVlOiBudWxsCiAgcHJpb3JpdHlfY2xhc3M6IG51bGwKICBjcHU6IG51bGwKICBtZW1vcnk6IG51bGwKb3V0cHV0X2RpcjogZ3M6Ly9teS1idWNrZXQvb3V0Cg== --restart-on-exit-codes=1 --termination-grace-period-seconds=150 --spot '--command=printf %s "$XLA_SHARD_CONFIG_0" | base64 -d > /tmp/config.yaml && xla-shard train /tmp/config.yaml --set=launch.nnodes=2 --set=launch.rdzv_id=xla-shard-a3 --set=launch.rdzv_endpoint=xla-shard-a3-slice-job-0-0.xla-shard-a3:29500 --set=launch.node_rank="$NODE_RANK"'
