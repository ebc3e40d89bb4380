#!/usr/bin/env bash
# The trainers' own environment for the interop tests (tests/trainers/). Idempotent.
#
# Creates ${LAYERTAP_TRAINERS_VENV:-/opt/trainers-venv} with SpecForge 0.2.0 and speculators 0.9.0, whose
# EAGLE-3 data loaders, draft models and losses the tests run on layertap's output. It is kept apart from the
# project venv: both trainers pin torch/transformers of their own.
#
# - torch 2.13.0, CPU build: speculators allows torch 2.9-2.14.1; SpecForge pins torch==2.11.0 (a CUDA build of
#   several GB) but its offline EAGLE-3 path runs on 2.13 (the test proves it), so the local CPU wheel is used.
# - transformers 5.8.1: SpecForge's pin, inside speculators' range (5.0-5.19).
# - Both trainers are installed --no-deps, with the dependencies their training code imports pinned in
#   scripts/trainers-requirements.txt. Left out on purpose: sglang 0.5.14 (SpecForge's online capture only),
#   torchvision/torchaudio (speculators' multimodal paths), wandb/tensorboard (trackers), yunchang (sequence
#   parallelism). Mooncake's CPU wheel and redis are in, at the project's pins: a trainer process that reads
#   layertap's stream (tests/trainers/run_*.py --stream) imports layertap.stream.consumer, which needs them besides
#   torch, safetensors, pydantic and hs-connectors (layertap itself comes on PYTHONPATH, not installed here).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV="${LAYERTAP_TRAINERS_VENV:-/opt/trainers-venv}"
stamp="${VENV}/.layertap-trainers"
want="$(cat scripts/trainers-requirements.txt scripts/setup_trainers.sh | sha256sum | cut -d' ' -f1)"
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
  exit 0
fi
[[ -x "${VENV}/bin/python" ]] || python3.11 -m venv "${VENV}"
"${VENV}/bin/pip" install --quiet --disable-pip-version-check -r scripts/trainers-requirements.txt
"${VENV}/bin/pip" install --quiet --disable-pip-version-check --no-deps specforge==0.2.0 speculators==0.9.0 \
  hs-connectors==0.9.0
"${VENV}/bin/python" -c "import specforge, speculators, hs_connectors"
echo "$want" >"$stamp"
