#!/usr/bin/env bash
# The test command of the README (and CI): lint, then the whole suite at both ends of the torch range
# xla_shard accepts, each in its own virtualenv, the unit tier before the end-to-end tier:
#   .venv         torch 2.9 + torch_xla 2.9 (extras xla, scan, aot: libtpu for xla-shard compile): every test
#   .venv-newest  the newest torch without torch_xla, TorchTPU installed: the same tests, the ones that need
#                 torch_xla skipping (marker `xla`)
#   .venv-xpk     xpk alone (it pins its dependencies exactly): tests/test_gke.py runs its argument parser
# TIERS=old or TIERS=newest runs one environment only.
set -euo pipefail
cd "$(dirname "$0")/.."
NEWEST_TORCH="2.15.0"
XPK_VERSION="1.16.0"
TIERS="${TIERS:-old newest}"

python3 -m venv .venv-xpk
.venv-xpk/bin/pip install -q "xpk==$XPK_VERSION"

if [[ " $TIERS " == *" old "* ]]; then
  python3 -m venv .venv
  .venv/bin/pip install -q -e '.[xla,scan,aot,test]'
  .venv/bin/ruff check
  .venv/bin/python -m pytest -q -m "not e2e"
  .venv/bin/python -m pytest -q -m e2e
fi
if [[ " $TIERS " == *" newest "* ]]; then
  python3 -m venv .venv-newest
  # No machine-wide pip configuration: some images constrain torch below the release under test.
  PIP_CONFIG_FILE=/dev/null .venv-newest/bin/pip install -q -e '.[torchtpu,test]' "torch==$NEWEST_TORCH"
  .venv-newest/bin/python -m pytest -q -m "not e2e and not xla"
  .venv-newest/bin/python -m pytest -q -m "e2e and not xla"
fi
