# syntax=docker/dockerfile:1
# kvrouter: one image for every command (`tracker`, `router`, `replica`, `attach`, `lookup`).
# Build: docker build -t kvrouter .   Run: docker run --rm kvrouter router --help
# docker-compose.yml runs the whole stack from it; docs/deployment.md explains the ports.

# --- build: a wheel of kvrouter and of each dependency, from the source tree -------------
FROM python:3.11-slim AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY tracker/ tracker/
COPY router/ router/
COPY publishers/ publishers/
COPY bench/ bench/
RUN pip wheel --wheel-dir /wheels .

# --- runtime: the installed package, no sources, no build tools, not root ----------------
FROM python:3.11-slim
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-index --find-links /wheels kvrouter \
    && groupadd --gid 10001 kvrouter \
    && useradd --uid 10001 --gid 10001 --create-home --shell /usr/sbin/nologin kvrouter
USER 10001:10001
WORKDIR /home/kvrouter

# 8000: the router's (and a simulated engine's) HTTP port; 9100: the tracker's /metrics and
# /health. A simulated engine's ZMQ event/replay ports (5557/5558 by default) are not listed
# on purpose: they have no authentication and must stay on a private network.
EXPOSE 8000 9100

# No curl in the image: probe with the standard library. HEALTHCHECK_URL says which /health
# (tracker: http://127.0.0.1:9100/health); any error or a non-2xx answer is unhealthy.
ENV HEALTHCHECK_URL=http://127.0.0.1:8000/health
HEALTHCHECK --interval=10s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen(os.environ['HEALTHCHECK_URL'], timeout=3)"]

# SIGTERM (docker stop) drains in-flight requests; give routers --shutdown-timeout-s plus a
# margin (compose: stop_grace_period).
STOPSIGNAL SIGTERM
ENTRYPOINT ["kvrouter"]
CMD ["router", "--host", "0.0.0.0", "--port", "8000"]
