# The TIR sandbox (DockerSandbox's default image, opd-sandbox-tir:latest): Debian with
# python3 (+ numpy and sympy by default) and a non-root user `sandbox` (uid 1000) that owns
# /work. DockerSandbox runs it read-only, without network, capabilities or swap; this image
# only has to provide the interpreter and the user. Build (see docker/README.md for a base
# that needs no registry):
#   DOCKER_BUILDKIT=0 docker build -f docker/sandbox-tir.Dockerfile -t opd-sandbox-tir:latest docker/
ARG BASE=debian:bookworm-slim
FROM ${BASE}

# Installed with apt when set (needs the Debian mirror); empty keeps what BASE already has,
# which must then include python3.
ARG PACKAGES="python3 python3-numpy python3-sympy"
# Versions come from the Debian release BASE names: exact apt pins break as soon as the
# mirror drops a superseded point release; pin BASE (a tag or digest) to fix the set.
# hadolint ignore=DL3008
RUN set -eu; \
    if [ -n "$PACKAGES" ]; then \
        apt-get update; \
        DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $PACKAGES; \
        rm -rf /var/lib/apt/lists/*; \
    fi; \
    python3 --version; \
    useradd --create-home --uid 1000 --user-group --shell /bin/bash sandbox; \
    mkdir -p /work; \
    chown sandbox:sandbox /work

ENV LANG=C.UTF-8 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
# Numeric, so DockerSandbox can hand it the working directory without reading /etc/passwd.
USER 1000:1000
WORKDIR /work
CMD ["sleep", "infinity"]
