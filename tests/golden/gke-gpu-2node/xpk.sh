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
run "$XPK" workload create --workload=xla-shard-a3 --cluster=gpu-cluster --project=my-project --zone=us-central1-a --namespace=default --device-type=h100-80gb-8 --num-nodes=2 --docker-image=us-docker.pkg.dev/p1/xla-shard:1 --max-restarts=5 --env=XLA_SHARD_CONFIG_0=YmFja2VuZDogdG9yY2hfZnNkcAptZXRob2Q6IHNmdApjcHVfZGV2aWNlczogNAptb2RlbDoKICBuYW1lOiBzbWFsbC1sbGFtYQogIGluaXQ6IGF1dG8KICB0YXNrOiBjYXVzYWxfbG0KICBudW1fbGFiZWxzOiBudWxsCiAgb3ZlcnJpZGVzOiB7fQogIGF0dG5faW1wbGVtZW50YXRpb246IGF1dG8KICBsb3JhOiBudWxsCmZzZHA6CiAgc2hhcmRpbmdfc3RyYXRlZ3k6IEZVTExfU0hBUkQKICBzaGFyZGluZzogbnVsbAogIGF1dG9fd3JhcF9wb2xpY3k6IFRSQU5TRk9STUVSX0JBU0VEX1dSQVAKICB0cmFuc2Zvcm1lcl9sYXllcl9jbHNfdG9fd3JhcDogW10KICBtaW5fbnVtX3BhcmFtczogMTAwMDAwMDAwCiAgYWN0aXZhdGlvbl9jaGVja3BvaW50aW5nOiB0cnVlCiAgc2Nhbl9sYXllcnM6IGZhbHNlCiAgb2ZmbG9hZF9wYXJhbXM6IGZhbHNlCiAgbWl4ZWRfcHJlY2lzaW9uOiBiZjE2CiAgYWN0aXZhdGlvbl9kdHlwZTogbnVsbAogIHN0YXRlX2RpY3RfdHlwZTogU0hBUkRFRF9TVEFURV9ESUNUCiAgYnVja2V0X2NhcF9tYjogMjUuMAogIHhsYV9zZXR0aW5nczoge30KbWVzaDoKICBmc2RwOiAtMQogIHJlcGxpY2E6IDEKICBjb250ZXh0OiAxCnRyYWluOgogIHN0ZXBzOiAyMDAKICBlcG9jaHM6IG51bGwKICBnbG9iYWxfYmF0Y2hfc2l6ZTogMzIKICBzZXFfbGVuOiAyNTYKICBvcHRpbWl6ZXI6IGFkYW13CiAgbHI6IDAuMDAxCiAgbHJfc2NoZWR1bGU6IGNvbnN0YW50CiAgbHJfd2FybXVwX3N0ZXBzOiAwCiAgbHJfbWluX3JhdGlvOiAwLjAKICB3ZWlnaHRfZGVjYXk6IDAuMAogIG1heF9ncmFkX25vcm06IG51bGwKICBncmFkX2FjY3VtX3N0ZXBzOiAxCiAgbG9zc19jaHVua3M6IGF1dG8KICBjb21waWxlOiBmYWxzZQogIHNlZWQ6IDAKICBsb2dfZXZlcnk6IDEKICBldmFsX2V2ZXJ5OiBudWxsCiAgZXZhbF9zdGVwczogbnVsbAogIHRlbnNvcmJvYXJkOiBmYWxzZQogIHBlYWtfZmxvcHNfcGVyX2RldmljZTogbnVsbAogIHJlY29tcGlsZV93YXJtdXBfc3RlcHM6IDIKZGF0YToKICBwYXRoOiBzeW50aGV0aWMKICBmb3JtYXQ6IG51bGwKICB0b2tlbml6ZXI6IG51bGwKICBraW5kOiB0ZXh0CiAgdGV4dF9maWVsZDogdGV4dAogIG1lc3NhZ2VzX2ZpZWxkOiBtZXNzYWdlcwogIHByb21wdF9maWVsZDogcHJvbXB0CiAgY29tcGxldGlvbl9maWVsZDogY29tcGxldGlvbgogIGNob3Nlbl9maWVsZDogY2hvc2VuCiAgcmVqZWN0ZWRfZmllbGQ6IHJlamVjdGVkCiAgY29tcGxldGlvbl9vbmx5X2xvc3M6IG51bGwKICB0ZXh0X2ZpZWxkczoKICAtIHRleHQKICBsYWJlbF9maWVsZDogbGFiZWwKICBwYWNraW5nOiB0cnVlCiAgcGFja2luZ19zdHJhdGVneTogbnVsbAogIGV2YWxfcGF0aDogbnVsbAogIGV2YWxfZnJhY3Rpb246IDAuMAogIG51bV9wcm9jOiBudWxsCiAgc3RyZWFtaW5nOiBmYWxzZQogIHNodWZmbGVfYnVmZmVyOiAxMDAwMApsYXVuY2g6CiAgbnByb2NfcGVyX25vZGU6IG51bGwKICBubm9kZXM6IDEKICBub2RlX3Jhbms6IG51bGwKICByZHp2X2VuZHBvaW50OiBudWxsCiAgcmR6dl9pZDogeGxhX3NoYXJkCiAgdGltZW91dF9zOiA2MDAuMApjaGVja3BvaW50OgogIGRpcjogZ3M6Ly9teS1idWNrZXQveGxhLXNoYXJkL3NtYWxsLWxsYW1hLWdwdQogIGV2ZXJ5X3N0ZXBzOiA1MAogIGtlZXBfbGFzdDogMwogIGtlZXBfZXZlcnk6IG51bGwKICBhc3luYzogdHJ1ZQogIHJlc3VtZTogYXV0bwogIHByZWVtcHRpb25fZ3JhY2VfczogMTIwLjAKICByZXRyeV9kZWFkbGluZV9zOiAxMjAuMAogIGNvbW1pdF90aW1lb3V0X3M6IDYwMC4wCmRlcGxveToKICBwcm9qZWN0OiBteS1wcm9qZWN0CiAgem9uZTogdXMtY2VudHJhbDEtYQogIG5hbWU6IHhsYS1zaGFyZC1hMwogIGFjY2VsZXJhdG9yX3R5cGU6IHY0LTgKICBwcm92aXNpb25pbmc6IHNwb3QKICBuZXR3b3JrOiBudWxsCiAgc3VibmV0d29yazogbnVsbAogIHNlcnZpY2VfYWNjb3VudDogbnVsbAogIHZhbGlkX3VudGlsOiA2aAogIGFsbG93X3VubGlzdGVkX3pvbmU6IGZhbHNlCiAgZ3B1X21hY2hpbmVfdHlwZTogYTMtaGlnaGdwdS04ZwogIGdwdV9ub2RlczogMgogIGdwdV9pbWFnZV9mYW1pbHk6IGNvbW1vbi1jdTEyOC11YnVudHUtMjIwNC1udmlkaWEtNTcwCiAgZ3B1X2ltYWdlX3Byb2plY3Q6IGRlZXBsZWFybmluZy1wbGF0Zm9ybS1yZWxlYXNlCiAgcmVtb3RlX3VzZXI6IHhsYXNoYXJkCiAgcmVtb3RlX2RpcjogeGxhX3NoYXJkCiAgY2x1c3RlcjogZ3B1LWNsdXN0ZXIKICBpbWFnZTogdXMtZG9ja2VyLnBrZy5kZXYvcDEveGxhLXNoYXJkOjEKICBuYW1lc3BhY2U6IGRlZmF1bHQKICBudW1fc2xpY2VzOiAxCiAgbWF4X3Jlc3RhcnRzOiA1CiAgcmVnaW9uOiBudWxsCiAgcXVldWU6IG51bGwKICBwcmlvcml0eV9jbGFzczogbnVsbAogIGNwdTogbnVsbAogIG1lbW9yeTogbnVsbApvdXRwdXRfZGlyOiBnczovL215LWJ1Y2tldC9vdXQK --restart-on-exit-codes=1 --termination-grace-period-seconds=150 --spot '--command=printf %s "$XLA_SHARD_CONFIG_0" | base64 -d > /tmp/config.yaml && xla-shard train /tmp/config.yaml --set=launch.nnodes=2 --set=launch.rdzv_id=xla-shard-a3 --set=launch.rdzv_endpoint=xla-shard-a3-slice-job-0-0.xla-shard-a3:29500 --set=launch.node_rank="$NODE_RANK"'
