#!/usr/bin/env bash
# Startup script (VM metadata), rendered by `xla-shard gcp render --target gpu-vm`. When the VM boots
# again after a preemption stopped it, training restarts and resumes from the newest committed checkpoint.
# It runs as root: every value below is a single-quoted word, and the remote user's command one more.
set -euo pipefail
user=xlashard
user_home="$(getent passwd "$user" | cut -d: -f6 || true)"
if [[ -n "$user_home" && -x "$user_home"/xla_shard/scripts/train_loop.sh ]]; then
  sudo -u "$user" -H bash -c 'cd ~/xla_shard && setsid nohup scripts/train_loop.sh ~/config.yaml >> ~/train.log 2>&1 < /dev/null &'
fi
