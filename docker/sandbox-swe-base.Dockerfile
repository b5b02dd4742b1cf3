# A base for SWE sandboxes (SWE-Gym / SWE-smith style tasks, the mini-SWE tasks): Debian
# with git, python3 (venv, pip, pytest) and a C toolchain, a non-root user `sandbox`
# (uid 1000) and /testbed, the repository's directory, owned by it. A task image adds its
# repository and dependencies on top (FROM this image, COPY --chown=1000:1000 the checkout
# to /testbed, `pip install` into /opt/venv). SWE-bench does not use it: its instances run
# in their own prebuilt images (swebench/sweb.eval.x86_64.*, repository at /testbed).
# Build (see docker/README.md for a base that needs no registry):
#   DOCKER_BUILDKIT=0 docker build -f docker/sandbox-swe-base.Dockerfile -t opd-sandbox-swe-base:latest docker/
ARG BASE=debian:bookworm-slim
FROM ${BASE}

# Installed with apt when set (needs the Debian mirror); empty keeps what BASE already has,
# which must then include git and python3 with its venv module.
ARG PACKAGES="build-essential ca-certificates git patch procps python3 python3-dev python3-pip python3-pytest python3-venv"
# Versions come from the Debian release BASE names: exact apt pins break as soon as the
# mirror drops a superseded point release; pin BASE (a tag or digest) to fix the set.
# safe.directory: the repository is put in place by another uid (the daemon's archive API,
# a task image's COPY); git's ownership check guards shared machines, not a one-user sandbox.
# hadolint ignore=DL3008
RUN set -eu; \
    if [ -n "$PACKAGES" ]; then \
        apt-get update; \
        DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $PACKAGES; \
        rm -rf /var/lib/apt/lists/*; \
    fi; \
    git --version; \
    python3 --version; \
    git config --system safe.directory '*'; \
    useradd --create-home --uid 1000 --user-group --shell /bin/bash sandbox; \
    mkdir -p /testbed /opt/venv; \
    chown sandbox:sandbox /testbed /opt/venv

ENV LANG=C.UTF-8 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PATH=/opt/venv/bin:$PATH
# Numeric, so DockerSandbox can hand it the working directory without reading /etc/passwd.
USER 1000:1000
# Debian's python3 refuses system-wide pip installs (PEP 668): task dependencies go into
# this venv, which also sees Debian's packages (pytest) and gives agents `python` and `pip`.
RUN python3 -m venv --system-site-packages /opt/venv && python --version
WORKDIR /testbed
CMD ["sleep", "infinity"]
