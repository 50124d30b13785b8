# syntax=docker/dockerfile:1
# vLLM with kvrouter installed in its Python environment, so that vLLM loads kvrouter's
# `vllm.general_plugins` entry point (publishers/vllm.py `register`), which registers the
# server in Redis when KVROUTER_ATTACH_REDIS is set (deploy/kubernetes/base/vllm.yaml).
# Build from the repository root:
#   docker build -f deploy/kubernetes/vllm.Dockerfile -t kvrouter-vllm:local .
# Pin the vLLM release you run; not built here (no Docker engine or GPU was available).
ARG VLLM_IMAGE=vllm/vllm-openai:latest
FROM ${VLLM_IMAGE}
COPY pyproject.toml README.md /tmp/kvrouter/
COPY tracker/ /tmp/kvrouter/tracker/
COPY router/ /tmp/kvrouter/router/
COPY publishers/ /tmp/kvrouter/publishers/
COPY bench/ /tmp/kvrouter/bench/
RUN python3 -m pip install --no-cache-dir /tmp/kvrouter && rm -rf /tmp/kvrouter
