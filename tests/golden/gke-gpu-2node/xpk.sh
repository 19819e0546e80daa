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
run "$XPK" workload create --workload=xla-shard-a3 --cluster=gpu-cluster --project=my-project --zone=us-central1-a --namespace=default --device-type=h100-80gb-8 --num-nodes=2 --docker-image=us-docker.pkg.dev/p1/xla-shard:1 --max-restarts=5 --env=XLA_SHARD_CONFIG_0=YmFja2VuZDogdG9yY2hfZnNkcApjcHVfZGV2aWNlczogNAptb2RlbDoKICBuYW1lOiBzbWFsbC1sbGFtYQogIGluaXQ6IGF1dG8KICB0YXNrOiBjYXVzYWxfbG0KICBudW1fbGFiZWxzOiBudWxsCiAgb3ZlcnJpZGVzOiB7fQogIGF0dG5faW1wbGVtZW50YXRpb246IGF1dG8KICBsb3JhOiBudWxsCmZzZHA6CiAgc2hhcmRpbmdfc3RyYXRlZ3k6IEZVTExfU0hBUkQKICBzaGFyZGluZzogbnVsbAogIGF1dG9fd3JhcF9wb2xpY3k6IFRSQU5TRk9STUVSX0JBU0VEX1dSQVAKICB0cmFuc2Zvcm1lcl9sYXllcl9jbHNfdG9fd3JhcDogW10KICBtaW5fbnVtX3BhcmFtczogMTAwMDAwMDAwCiAgYWN0aXZhdGlvbl9jaGVja3BvaW50aW5nOiB0cnVlCiAgc2Nhbl9sYXllcnM6IGZhbHNlCiAgb2ZmbG9hZF9wYXJhbXM6IGZhbHNlCiAgbWl4ZWRfcHJlY2lzaW9uOiBiZjE2CiAgYWN0aXZhdGlvbl9kdHlwZTogbnVsbAogIHN0YXRlX2RpY3RfdHlwZTogU0hBUkRFRF9TVEFURV9ESUNUCiAgYnVja2V0X2NhcF9tYjogMjUuMAogIHhsYV9zZXR0aW5nczoge30KbWVzaDoKICBmc2RwOiAtMQogIHJlcGxpY2E6IDEKdHJhaW46CiAgc3RlcHM6IDIwMAogIGVwb2NoczogbnVsbAogIGdsb2JhbF9iYXRjaF9zaXplOiAzMgogIHNlcV9sZW46IDI1NgogIG9wdGltaXplcjogYWRhbXcKICBscjogMC4wMDEKICBscl9zY2hlZHVsZTogY29uc3RhbnQKICBscl93YXJtdXBfc3RlcHM6IDAKICBscl9taW5fcmF0aW86IDAuMAogIHdlaWdodF9kZWNheTogMC4wCiAgbWF4X2dyYWRfbm9ybTogbnVsbAogIGdyYWRfYWNjdW1fc3RlcHM6IDEKICBsb3NzX2NodW5rczogYXV0bwogIGNvbXBpbGU6IGZhbHNlCiAgc2VlZDogMAogIGxvZ19ldmVyeTogMQogIGV2YWxfZXZlcnk6IG51bGwKICBldmFsX3N0ZXBzOiBudWxsCiAgdGVuc29yYm9hcmQ6IGZhbHNlCiAgcGVha19mbG9wc19wZXJfZGV2aWNlOiBudWxsCiAgcmVjb21waWxlX3dhcm11cF9zdGVwczogMgpkYXRhOgogIHBhdGg6IHN5bnRoZXRpYwogIGZvcm1hdDogbnVsbAogIHRva2VuaXplcjogbnVsbAogIGtpbmQ6IHRleHQKICB0ZXh0X2ZpZWxkOiB0ZXh0CiAgbWVzc2FnZXNfZmllbGQ6IG1lc3NhZ2VzCiAgcHJvbXB0X2ZpZWxkOiBwcm9tcHQKICBjb21wbGV0aW9uX2ZpZWxkOiBjb21wbGV0aW9uCiAgY2hvc2VuX2ZpZWxkOiBjaG9zZW4KICByZWplY3RlZF9maWVsZDogcmVqZWN0ZWQKICBjb21wbGV0aW9uX29ubHlfbG9zczogbnVsbAogIHRleHRfZmllbGRzOgogIC0gdGV4dAogIGxhYmVsX2ZpZWxkOiBsYWJlbAogIHBhY2tpbmc6IHRydWUKICBldmFsX3BhdGg6IG51bGwKICBldmFsX2ZyYWN0aW9uOiAwLjAKICBudW1fcHJvYzogbnVsbAogIHN0cmVhbWluZzogZmFsc2UKICBzaHVmZmxlX2J1ZmZlcjogMTAwMDAKZHBvOgogIGJldGE6IDAuMQogIGxvc3NfdHlwZTogc2lnbW9pZAogIGxhYmVsX3Ntb290aGluZzogMC4wCiAgcmVmZXJlbmNlOiBudWxsCmxhdW5jaDoKICBucHJvY19wZXJfbm9kZTogbnVsbAogIG5ub2RlczogMQogIG5vZGVfcmFuazogbnVsbAogIHJkenZfZW5kcG9pbnQ6IG51bGwKICByZHp2X2lkOiB4bGFfc2hhcmQKICB0aW1lb3V0X3M6IDYwMC4wCmNoZWNrcG9pbnQ6CiAgZGlyOiBnczovL215LWJ1Y2tldC94bGEtc2hhcmQvc21hbGwtbGxhbWEtZ3B1CiAgZXZlcnlfc3RlcHM6IDUwCiAga2VlcF9sYXN0OiAzCiAga2VlcF9ldmVyeTogbnVsbAogIGFzeW5jOiB0cnVlCiAgcmVzdW1lOiBhdXRvCiAgcHJlZW1wdGlvbl9ncmFjZV9zOiAxMjAuMAogIHJldHJ5X2RlYWRsaW5lX3M6IDEyMC4wCiAgY29tbWl0X3RpbWVvdXRfczogNjAwLjAKZGVwbG95OgogIHByb2plY3Q6IG15LXByb2plY3QKICB6b25lOiB1cy1jZW50cmFsMS1hCiAgbmFtZTogeGxhLXNoYXJkLWEzCiAgYWNjZWxlcmF0b3JfdHlwZTogdjQtOAogIHByb3Zpc2lvbmluZzogc3BvdAogIG5ldHdvcms6IG51bGwKICBzdWJuZXR3b3JrOiBudWxsCiAgc2VydmljZV9hY2NvdW50OiBudWxsCiAgdmFsaWRfdW50aWw6IDZoCiAgYWxsb3dfdW5saXN0ZWRfem9uZTogZmFsc2UKICBncHVfbWFjaGluZV90eXBlOiBhMy1oaWdoZ3B1LThnCiAgZ3B1X25vZGVzOiAyCiAgZ3B1X2ltYWdlX2ZhbWlseTogY29tbW9uLWN1MTI4LXVidW50dS0yMjA0LW52aWRpYS01NzAKICBncHVfaW1hZ2VfcHJvamVjdDogZGVlcGxlYXJuaW5nLXBsYXRmb3JtLXJlbGVhc2UKICByZW1vdGVfdXNlcjogeGxhc2hhcmQKICByZW1vdGVfZGlyOiB4bGFfc2hhcmQKICBjbHVzdGVyOiBncHUtY2x1c3RlcgogIGltYWdlOiB1cy1kb2NrZXIucGtnLmRldi9wMS94bGEtc2hhcmQ6MQogIG5hbWVzcGFjZTogZGVmYXVsdAogIG51bV9zbGljZXM6IDEKICBtYXhfcmVzdGFydHM6IDUKICByZWdpb246IG51bGwKICBxdWV1ZTogbnVsbAogIHByaW9yaXR5X2NsYXNzOiBudWxsCiAgY3B1OiBudWxsCiAgbWVtb3J5OiBudWxsCm91dHB1dF9kaXI6IGdzOi8vbXktYnVja2V0L291dAo= --restart-on-exit-codes=1 --termination-grace-period-seconds=150 --spot '--command=printf %s "$XLA_SHARD_CONFIG_0" | base64 -d > /tmp/config.yaml && xla-shard train /tmp/config.yaml --set=launch.nnodes=2 --set=launch.rdzv_id=xla-shard-a3 --set=launch.rdzv_endpoint=xla-shard-a3-slice-job-0-0.xla-shard-a3:29500 --set=launch.node_rank="$NODE_RANK"'
