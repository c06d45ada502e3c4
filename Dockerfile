# textgen images, one Dockerfile, two targets:
#
#   docker build --target gateway -t textgen-gateway .   # gateway AND scheduler: no torch
#   docker build --target worker  -t textgen-worker  .   # worker: CPU torch
#   docker build --target worker  -t textgen-worker:gpu \
#       --build-arg TORCH_INDEX_URL=https://pypi.org/simple \
#       --build-arg GPU_PACKAGES=flash-attn .                   # worker: CUDA torch + flash-attn
#
# PyPI's Linux torch wheels are the CUDA builds (they pull the nvidia-* runtime wheels), so the
# GPU image is the same recipe with another index; the host only needs the NVIDIA driver and
# the NVIDIA container toolkit. Every image runs `textgen <subcommand>` as uid 1000.

ARG PYTHON_IMAGE=python:3.11-slim

# ---- base: python and an unprivileged user ---------------------------------------------------
FROM ${PYTHON_IMAGE} AS base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    HF_HOME=/data/hf
# /data/hf is the Hugging Face cache (a volume in compose and k8s). It exists in the image and
# belongs to uid 1000, so a fresh named volume inherits that owner. /models is where local model
# folders are mounted read-only.
RUN groupadd --gid 1000 textgen \
 && useradd --uid 1000 --gid 1000 --create-home --shell /usr/sbin/nologin textgen \
 && mkdir -p /data/hf /models \
 && chown -R 1000:1000 /data
WORKDIR /app

# ---- builders: dependencies first (a cached layer), then the project -------------------------
FROM base AS build-base
RUN python -m venv /opt/venv
COPY pyproject.toml ./
# The dependencies named in pyproject.toml, installed before the source is copied so that
# editing code does not reinstall them.
RUN python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
print('\n'.join(p['dependencies']))" > /tmp/requirements.txt \
 && pip install -r /tmp/requirements.txt

FROM build-base AS build-gateway
COPY shared ./shared
COPY services ./services
# The gateway/scheduler image must stay free of torch.
RUN pip install . && ! pip show torch >/dev/null 2>&1

FROM build-base AS build-worker
# Where torch comes from: the CPU wheel index by default, PyPI (CUDA builds) for the GPU image.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# torch first, from its index, with the exact pin of the `worker` extra; the rest (and the
# `quantize` extra: bitsandbytes) from PyPI.
RUN python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
print('\n'.join(p['optional-dependencies']['worker'] + p['optional-dependencies']['quantize']))" \
      > /tmp/worker.txt \
 && pip install --index-url "${TORCH_INDEX_URL}" $(grep -E '^torch([=<>~!; ]|$)' /tmp/worker.txt) \
 && pip install -r /tmp/worker.txt
COPY shared ./shared
COPY services ./services
# torch is already satisfied (2.x.y+cpu matches ==2.x.y), so this adds only the project.
RUN pip install ".[worker,quantize]" && python -c "import torch, transformers, bitsandbytes"
# Extra worker packages built against that torch: the GPU image adds flash-attn
# (`--build-arg GPU_PACKAGES=flash-attn`). Compiling it needs nvcc: build that image from a
# CUDA "devel" base with Python 3.11 (`--build-arg PYTHON_IMAGE=...`); no GPU is needed to build.
ARG GPU_PACKAGES=""
RUN if [ -n "${GPU_PACKAGES}" ]; then \
      MAX_JOBS=4 pip install --no-build-isolation ${GPU_PACKAGES}; \
    fi

# ---- gateway (also the scheduler image) ------------------------------------------------------
FROM base AS gateway
COPY --from=build-gateway /opt/venv /opt/venv
USER 1000:1000
EXPOSE 3000
ENTRYPOINT ["textgen"]
# --hostname as a flag, not HOSTNAME: Docker and Kubernetes set HOSTNAME to the container name,
# and the `hostname` setting (the bind address) would read it from the environment.
CMD ["gateway", "--hostname", "0.0.0.0"]

# ---- worker ----------------------------------------------------------------------------------
FROM base AS worker
# A C compiler: at its first start the worker builds its CPU kernels for the host's own CPU
# (services/worker/kernels); without one it runs transformers' modules, slower.
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build-worker /opt/venv /opt/venv
# Read by the NVIDIA container toolkit; harmless on CPU.
ENV NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
USER 1000:1000
ENTRYPOINT ["textgen"]
CMD ["worker"]
