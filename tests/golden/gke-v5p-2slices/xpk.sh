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


# The same workload as jobset.yaml, created by xpk (its cluster set up by `xpk cluster create`); the config
# travels in the pods' environment, base64-encoded. A $NAME in --command is the pod's to expand, not this
# script's:
# shellcheck disable=SC2016
run "$XPK" workload create --workload=xla-shard-v4 --cluster=train-cluster --project=my-project --zone=us-east5-a --namespace=default --tpu-type=v5p-32 --num-slices=2 --docker-image=us-docker.pkg.dev/p1/xla-shard:1 --max-restarts=5 --env=XLA_SHARD_CONFIG_0=YmFja2VuZDogeGxhX3NwbWQKbWV0aG9kOiBzZnQKY3B1X2RldmljZXM6IDQKbW9kZWw6CiAgbmFtZTogc21hbGwtbGxhbWEKICBpbml0OiBhdXRvCiAgdGFzazogY2F1c2FsX2xtCiAgbnVtX2xhYmVsczogbnVsbAogIG92ZXJyaWRlczoge30KICBhdHRuX2ltcGxlbWVudGF0aW9uOiBhdXRvCiAgbG9yYTogbnVsbApmc2RwOgogIHNoYXJkaW5nX3N0cmF0ZWd5OiBGVUxMX1NIQVJECiAgc2hhcmRpbmc6IG51bGwKICBhdXRvX3dyYXBfcG9saWN5OiBUUkFOU0ZPUk1FUl9CQVNFRF9XUkFQCiAgdHJhbnNmb3JtZXJfbGF5ZXJfY2xzX3RvX3dyYXA6IFtdCiAgbWluX251bV9wYXJhbXM6IDEwMDAwMDAwMAogIGFjdGl2YXRpb25fY2hlY2twb2ludGluZzogdHJ1ZQogIHNjYW5fbGF5ZXJzOiBmYWxzZQogIG9mZmxvYWRfcGFyYW1zOiBmYWxzZQogIG1peGVkX3ByZWNpc2lvbjogJ25vJwogIGFjdGl2YXRpb25fZHR5cGU6IG51bGwKICBzdGF0ZV9kaWN0X3R5cGU6IFNIQVJERURfU1RBVEVfRElDVAogIGJ1Y2tldF9jYXBfbWI6IDI1LjAKICB4bGFfc2V0dGluZ3M6IHt9Cm1lc2g6CiAgZnNkcDogLTEKICByZXBsaWNhOiAxCiAgY29udGV4dDogMQp0cmFpbjoKICBzdGVwczogMjAwCiAgZXBvY2hzOiBudWxsCiAgZ2xvYmFsX2JhdGNoX3NpemU6IDMyCiAgc2VxX2xlbjogMjU2CiAgb3B0aW1pemVyOiBhZGFtdwogIGxyOiAwLjAwMQogIGxyX3NjaGVkdWxlOiBjb25zdGFudAogIGxyX3dhcm11cF9zdGVwczogMAogIGxyX21pbl9yYXRpbzogMC4wCiAgd2VpZ2h0X2RlY2F5OiAwLjAKICBtYXhfZ3JhZF9ub3JtOiBudWxsCiAgZ3JhZF9hY2N1bV9zdGVwczogMQogIGxvc3NfY2h1bmtzOiBhdXRvCiAgY29tcGlsZTogZmFsc2UKICBzZWVkOiAwCiAgbG9nX2V2ZXJ5OiAxCiAgZXZhbF9ldmVyeTogbnVsbAogIGV2YWxfc3RlcHM6IG51bGwKICB0ZW5zb3Jib2FyZDogZmFsc2UKICBwZWFrX2Zsb3BzX3Blcl9kZXZpY2U6IG51bGwKICByZWNvbXBpbGVfd2FybXVwX3N0ZXBzOiAyCmRhdGE6CiAgcGF0aDogc3ludGhldGljCiAgZm9ybWF0OiBudWxsCiAgdG9rZW5pemVyOiBudWxsCiAga2luZDogdGV4dAogIHRleHRfZmllbGQ6IHRleHQKICBtZXNzYWdlc19maWVsZDogbWVzc2FnZXMKICBwcm9tcHRfZmllbGQ6IHByb21wdAogIGNvbXBsZXRpb25fZmllbGQ6IGNvbXBsZXRpb24KICBjaG9zZW5fZmllbGQ6IGNob3NlbgogIHJlamVjdGVkX2ZpZWxkOiByZWplY3RlZAogIGNvbXBsZXRpb25fb25seV9sb3NzOiBudWxsCiAgdGV4dF9maWVsZHM6CiAgLSB0ZXh0CiAgbGFiZWxfZmllbGQ6IGxhYmVsCiAgcGFja2luZzogdHJ1ZQogIHBhY2tpbmdfc3RyYXRlZ3k6IG51bGwKICBldmFsX3BhdGg6IG51bGwKICBldmFsX2ZyYWN0aW9uOiAwLjAKICBudW1fcHJvYzogbnVsbAogIHN0cmVhbWluZzogZmFsc2UKICBzaHVmZmxlX2J1ZmZlcjogMTAwMDAKbGF1bmNoOgogIG5wcm9jX3Blcl9ub2RlOiBudWxsCiAgbm5vZGVzOiAxCiAgbm9kZV9yYW5rOiBudWxsCiAgcmR6dl9lbmRwb2ludDogbnVsbAogIHJkenZfaWQ6IHhsYV9zaGFyZAogIHRpbWVvdXRfczogNjAwLjAKY2hlY2twb2ludDoKICBkaXI6IGdzOi8vbXktYnVja2V0L3hsYS1zaGFyZC9zbWFsbC1sbGFtYQogIGV2ZXJ5X3N0ZXBzOiA1MAogIGtlZXBfbGFzdDogMgogIGtlZXBfZXZlcnk6IG51bGwKICBhc3luYzogdHJ1ZQogIHJlc3VtZTogYXV0bwogIHByZWVtcHRpb25fZ3JhY2VfczogMTIwLjAKICByZXRyeV9kZWFkbGluZV9zOiAxMjAuMAogIGNvbW1pdF90aW1lb3V0X3M6IDYwMC4wCmRlcGxveToKICBwcm9qZWN0OiBteS1wcm9qZWN0CiAgem9uZTogdXMtZWFzdDUtYQogIG5hbWU6IHhsYS1zaGFyZC12NAogIGFjY2VsZXJhdG9yX3R5cGU6IHY1cC0zMgogIHByb3Zpc2lvbmluZzogc3BvdAogIG5ldHdvcms6IG51bGwKICBzdWJuZXR3b3JrOiBudWxsCiAgc2VydmljZV9hY2NvdW50OiBudWxsCiAgdmFsaWRfdW50aWw6IDZoCiAgYWxsb3dfdW5saXN0ZWRfem9uZTogZmFsc2UKICBncHVfbWFjaGluZV90eXBlOiBhMy1oaWdoZ3B1LThnCiAgZ3B1X25vZGVzOiAxCiAgZ3B1X2ltYWdlX2ZhbWlseTogY29tbW9uLWN1MTI4LXVidW50dS0yMjA0LW52aWRpYS01NzAKICBncHVfaW1hZ2VfcHJvamVjdDogZGVlcGxlYXJuaW5nLXBsYXRmb3JtLXJlbGVhc2UKICByZW1vdGVfdXNlcjogeGxhc2hhcmQKICByZW1vdGVfZGlyOiB4bGFfc2hhcmQKICBjbHVzdGVyOiB0cmFpbi1jbHVzdGVyCiAgaW1hZ2U6IHVzLWRvY2tlci5wa2cuZGV2L3AxL3hsYS1zaGFyZDoxCiAgbmFtZXNwYWNlOiBkZWZhdWx0CiAgbnVtX3NsaWNlczogMgogIG1heF9yZXN0YXJ0czogNQogIHJlZ2lvbjogbnVsbAogIHF1ZXVlOiBudWxsCiAgcHJpb3JpdHlfY2xhc3M6IG51bGwKICBjcHU6IG51bGwKICBtZW1vcnk6IG51bGwKb3V0cHV0X2RpcjogZ3M6Ly9teS1idWNrZXQvb3V0Cg== --restart-on-exit-codes=1 --termination-grace-period-seconds=150 --spot '--command=printf %s "$XLA_SHARD_CONFIG_0" | base64 -d > /tmp/config.yaml && PJRT_DEVICE=TPU MASTER_ADDR=xla-shard-v4-slice-job-0-0.xla-shard-v4 xla-shard train /tmp/config.yaml'
