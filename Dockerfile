# syntax=docker/dockerfile:1
# Images for docker-compose.yml. Two targets:
#   layertap    the coordinator, the CPU worker (HF engine) and Mooncake's master: Python 3.11 + layertap.
#   worker-gpu  an SGLang image (the server's own environment) + layertap in a separate venv: the
#               two pin different torch/transformers versions, and only sglang_patch (stdlib, torch,
#               sglang, safetensors) has to be importable inside the server, which the launcher
#               arranges through a folder holding only a link to the installed sglang_patch.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG SGLANG_IMAGE=lmsysorg/sglang:v0.5.14
# A CPU-only torch wheel index keeps the image small (the worker reads dumps on the CPU); empty
# means PyPI's default torch build.
ARG TORCH_INDEX_URL=

# The project's files, once, for both targets.
FROM scratch AS source
COPY pyproject.toml README.md /app/
COPY layertap /app/layertap
COPY coordinator /app/coordinator
COPY worker /app/worker
COPY sglang_patch /app/sglang_patch

FROM ${PYTHON_IMAGE} AS layertap
ARG TORCH_INDEX_URL
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PATH=/opt/layertap/bin:$PATH
# libibverbs1: Mooncake's wheel (the stream extra: `--stream mooncake`, the mooncake-master service) links it.
RUN apt-get update && apt-get install -y --no-install-recommends libibverbs1 && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/layertap
WORKDIR /app
COPY --from=source /app /app
RUN if [ -n "$TORCH_INDEX_URL" ]; then pip install --index-url "$TORCH_INDEX_URL" torch==2.13.0; fi \
 && pip install -e "/app[stream]"
EXPOSE 8000 9100

FROM ${SGLANG_IMAGE} AS worker-gpu
ARG TORCH_INDEX_URL
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
# layertap wants Python >= 3.11 whatever the SGLang image ships: uv brings its own interpreter.
RUN python3 -m pip install uv && uv venv --python 3.11 /opt/layertap
WORKDIR /app
COPY --from=source /app /app
RUN if [ -n "$TORCH_INDEX_URL" ]; then uv pip install --python /opt/layertap/bin/python --index-url "$TORCH_INDEX_URL" torch==2.13.0; fi \
 && uv pip install --python /opt/layertap/bin/python -e /app
# The worker runs from the layertap venv; it launches the capture server with the image's python3.
ENV PATH=/opt/layertap/bin:$PATH LAYERTAP_SGLANG_PYTHON=/usr/bin/python3
EXPOSE 9100
