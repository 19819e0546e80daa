#!/usr/bin/env bash
# Run training until it finishes, restarting after preemption or a crash; each restart resumes from the
# newest committed checkpoint (checkpoint.resume: auto).
#   scripts/train_loop.sh CONFIG [xla-shard train options...]
# Exit 0 from training means done. 143 means it stopped on SIGTERM after committing a checkpoint; 2 is a user
# mistake (bad config, refused checkpoint) that a restart would only repeat, and 130 a Ctrl-C (the user
# stopped it), so the loop stops on those; anything else is a failure. 143 and failures restart, up to
# MAX_RESTARTS times, RESTART_DELAY_S apart.
# XLA_SHARD_LAUNCHER replaces `xla-shard train` (e.g. a torchrun command); DRY_RUN=1 only prints.
set -euo pipefail
config="${1:?usage: train_loop.sh CONFIG [options...]}"
shift
DRY_RUN="${DRY_RUN:-0}"
MAX_RESTARTS="${MAX_RESTARTS:-100}"
RESTART_DELAY_S="${RESTART_DELAY_S:-30}"
VENV="${VENV:-$HOME/venv}"
read -r -a launcher <<< "${XLA_SHARD_LAUNCHER:-xla-shard train}"
if [[ -d "$VENV/bin" ]]; then PATH="$VENV/bin:$PATH"; fi

restarts=0
while true; do
  printf '+ %s\n' "${launcher[*]} $config $*" >&2
  if [[ "$DRY_RUN" == 1 ]]; then exit 0; fi
  status=0
  "${launcher[@]}" "$config" "$@" || status=$?
  if [[ "$status" == 0 ]]; then
    echo "train_loop: training finished" >&2
    exit 0
  fi
  if [[ "$status" == 2 ]]; then
    echo "train_loop: exit status 2 (a configuration or input error; see above); not restarting" >&2
    exit 2
  fi
  if [[ "$status" == 130 ]]; then
    echo "train_loop: stopped by Ctrl-C; not restarting (rerun this command to resume)" >&2
    exit 130
  fi
  if (( restarts >= MAX_RESTARTS )); then
    echo "train_loop: exit status $status after $restarts restart(s); giving up" >&2
    exit "$status"
  fi
  restarts=$((restarts + 1))
  echo "train_loop: exit status $status; restart $restarts/$MAX_RESTARTS in ${RESTART_DELAY_S}s (resumes)" >&2
  sleep "$RESTART_DELAY_S"
done
