# TorchServe image serving the speculative-decoding model archives.
#
#   docker build -t spec-serve:cpu .
#   docker build --build-arg VARIANT=cuda -t spec-serve:cuda .
#
# VARIANT picks the base stage: "cpu" (Debian, CPU-only torch) or "cuda"
# (NVIDIA CUDA base image, CUDA torch). Needs BuildKit (the default builder
# since Docker 23), which builds only the stage that VARIANT selects.
# deploy/README.md describes building, running and deploying.

ARG VARIANT=cpu
# bookworm rather than the floating tag: newer Debian releases no longer ship
# openjdk-17, which TorchServe 0.12 needs.
ARG CPU_BASE_IMAGE=python:3.11-slim-bookworm
# The torch wheel for CUDA brings its own CUDA libraries from PyPI, so the
# small "base" flavour is enough; a "runtime" image would only add a second
# copy of them. torch 2.13.0 is built for CUDA 13.0: the host needs an NVIDIA
# driver that supports CUDA 13.0 (580 or newer).
ARG CUDA_BASE_IMAGE=nvidia/cuda:13.0.0-base-ubuntu22.04

# --- CPU base: Python 3.11, Java 17, CPU-only torch ----------------------------
FROM ${CPU_BASE_IMAGE} AS base-cpu
ARG DEBIAN_FRONTEND=noninteractive
# The man1 folder: slim images drop it, and the JRE's post-install step
# fails without it.
RUN mkdir -p /usr/share/man/man1 \
    && apt-get update \
    && apt-get install -y --no-install-recommends openjdk-17-jre-headless tini \
    && rm -rf /var/lib/apt/lists/* \
    && python3.11 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# The CPU wheel index: PyPI's Linux torch wheel is the CUDA build, several GB
# of GPU libraries that a CPU image never loads.
ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "${TORCH_SPEC}"

# --- CUDA base: Python 3.11, Java 17, CUDA torch -------------------------------
FROM ${CUDA_BASE_IMAGE} AS base-cuda
ARG DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        python3.11 python3.11-venv openjdk-17-jre-headless tini ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && python3.11 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_INDEX_URL=https://pypi.org/simple
RUN pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "${TORCH_SPEC}"

# --- arctic-inference wheel (the suffix drafter's C++ suffix tree) --------------
# PyPI has only its source. Built here, with a compiler the serving image does not
# keep, against the torch above (its isolated build would pull an unpinned torch).
FROM base-${VARIANT} AS arctic
ARG DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/* \
    && pip install --no-cache-dir setuptools==84.2.1 wheel==0.48.0 ninja==1.13.2 cmake==4.4.5 nanobind==2.9.2 \
    && CMAKE_ARGS="-DPython_EXECUTABLE=/opt/venv/bin/python" pip wheel --no-cache-dir --no-build-isolation \
        --no-deps --no-binary arctic-inference -w /wheels arctic-inference==0.3.0

# --- Serving image -------------------------------------------------------------
FROM base-${VARIANT} AS serve

# Extra pip packages baked into the image, e.g. "accelerate" for a handler that
# loads a model with device_map="auto".
ARG EXTRA_PIP_PACKAGES=""
COPY requirements.txt /tmp/requirements.txt
# The constraint keeps the torch installed above: a requirement that pulls in
# torch must not swap the CPU build for PyPI's CUDA build, or the reverse.
RUN pip freeze | grep -i '^torch==' > /tmp/torch-constraint.txt \
    && pip install --no-cache-dir -c /tmp/torch-constraint.txt \
        -r /tmp/requirements.txt ${EXTRA_PIP_PACKAGES} \
    && rm /tmp/requirements.txt /tmp/torch-constraint.txt
COPY --from=arctic /wheels /tmp/wheels
RUN pip install --no-cache-dir --no-deps /tmp/wheels/*.whl && rm -r /tmp/wheels

# A fixed UID, so that Kubernetes' runAsUser and fsGroup can name it.
RUN groupadd --gid 1000 model-server \
    && useradd --uid 1000 --gid 1000 --create-home --home-dir /home/model-server \
        --shell /usr/sbin/nologin model-server \
    && mkdir -p /home/model-server/model-store /home/model-server/logs \
    && chown -R model-server:model-server /home/model-server

COPY deploy/docker/config.properties /home/model-server/config.properties
COPY model-config/metrics.yaml /home/model-server/metrics.yaml
COPY --chmod=0755 deploy/docker/entrypoint.sh /usr/local/bin/entrypoint.sh
COPY --chmod=0755 deploy/docker/healthcheck.py /usr/local/bin/healthcheck.py
# The archives in model_store/ at build time (.dockerignore lets only *.mar in).
# A volume mounted on /home/model-server/model-store at run time replaces them,
# which is how the Kubernetes manifests provide the models.
COPY --chown=model-server:model-server model_store/ /home/model-server/model-store/

# The archives carry the weights; the server never downloads from a model hub.
ENV HF_HUB_OFFLINE=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    MODEL_NAMES=qwen-coder-spec \
    MODEL_STORE=/home/model-server/model-store \
    TS_CONFIG=/home/model-server/config.properties

USER model-server
# TorchServe writes key_file.json (token authorization) and logs/ here.
WORKDIR /home/model-server

# 8080 inference, 8081 management, 8082 metrics (Prometheus).
EXPOSE 8080 8081 8082

# "Healthy" means the models are loaded: /ping answers, then every model has
# its workers READY. Loading the models can take minutes, hence the start period.
HEALTHCHECK --interval=30s --timeout=10s --start-period=600s --retries=3 \
    CMD ["healthcheck.py", "--ready", "--ping-url", "http://localhost:8080/ping"]

# tini is PID 1: it reaps the worker processes and hands SIGTERM to the
# entrypoint, which stops TorchServe cleanly.
ENTRYPOINT ["tini", "--", "entrypoint.sh"]
