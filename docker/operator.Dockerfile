# CONF-KV operator image: the Kopf operator only. It installs the confkv distribution without its
# dependencies (the engine's torch stack is not needed) plus the operator's own, pinned, runtime
# dependencies; tests/contracts checks that every third-party module the operator imports is listed.
#
#   docker build -f docker/operator.Dockerfile -t ghcr.io/confkv/confkv-operator:0.1.0 .

# Base image: pinned by tag, not by digest. A digest is only worth committing once it has been resolved
# against the registry and the image verified, and no registry was reachable where this file is
# maintained; an unverified digest would be worse than none. To pin it (the digest then decides; the
# tag stays for readers), resolve the digest and pass it in:
#
#   docker buildx imagetools inspect python:3.11.11-slim-bookworm --format '{{json .Manifest.Digest}}'
#   docker build --build-arg PYTHON_IMAGE=python:3.11.11-slim-bookworm@sha256:<digest> ...
#
# (tests/contracts/test_dockerfiles.py accepts either this documented tag or a well-formed digest.)
# There is no `# syntax=` line on purpose: it would pull an extra, unpinned frontend image.
ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY api/ api/
COPY engine/ engine/
COPY agent/ agent/
COPY operator/ operator/
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM ${PYTHON_IMAGE}
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/tmp

COPY --from=build /wheels/ /wheels/
RUN pip install kopf==1.45.2 kubernetes==37.0.2 pydantic==2.14.4 pyyaml==6.0.4 \
 && pip install --no-deps /wheels/confkv-*.whl \
 && rm -rf /wheels \
 && python -c "import confkv_operator.main"

RUN groupadd --system --gid 10001 confkv \
 && useradd --system --uid 10001 --gid 10001 --home-dir /tmp --shell /usr/sbin/nologin confkv
USER 10001:10001
WORKDIR /tmp

# Kopf's liveness endpoint (CONFKV_LIVENESS_PORT).
EXPOSE 8080
ENTRYPOINT []
CMD ["confkv-operator"]
