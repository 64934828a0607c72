# The image of every rollstream service: one `rollstream` console script, one subcommand per
# container (`proxy`, `workers`, `process`, `sink`, `train`, `serve-model`, `controller`).
# Configuration comes only from ROLLSTREAM_* variables at run time (docs/configuration.md);
# no secret is built in. How to build and run it: docs/deploy.md.
#
#   docker build -t rollstream:dev .
#   docker build --build-arg EXTRAS=proxy -t rollstream-proxy:dev .   # a smaller image
#
# PIP_EXTRA_INDEX_URL (build arg) adds a wheel index, e.g. PyTorch's CPU-only index so that
# the `train` extra does not bring the CUDA wheels.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ARG EXTRAS=all
ARG PIP_EXTRA_INDEX_URL=
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/rollstream
WORKDIR /src
COPY pyproject.toml README.md ./
COPY schemas ./schemas
COPY adapters ./adapters
COPY producers ./producers
COPY inference ./inference
COPY streams ./streams
COPY consumers ./consumers
COPY infra ./infra
RUN /opt/rollstream/bin/pip install "/src[${EXTRAS}]"

FROM ${PYTHON_IMAGE}
# bubblewrap: the rollout workers' default sandbox (it needs user namespaces: docs/deploy.md)
RUN apt-get update \
    && apt-get install -y --no-install-recommends bubblewrap \
    && rm -rf /var/lib/apt/lists/*
RUN groupadd --system --gid 10001 rollstream \
    && useradd --system --uid 10001 --gid 10001 --home-dir /var/lib/rollstream \
       --shell /usr/sbin/nologin rollstream \
    && mkdir -p /var/lib/rollstream/shared /var/lib/rollstream/spool \
    && chown -R 10001:10001 /var/lib/rollstream
COPY --from=build /opt/rollstream /opt/rollstream
ENV PATH=/opt/rollstream/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    ROLLSTREAM_HOME=/var/lib/rollstream \
    ROLLSTREAM_SPOOL_DIR=/var/lib/rollstream/spool
WORKDIR /var/lib/rollstream
USER 10001:10001
# model server, proxy, analytics (the sink), metrics and probes of the other services
EXPOSE 8100 8200 8300 9464
ENTRYPOINT ["rollstream"]
CMD ["--help"]
