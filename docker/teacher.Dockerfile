# The teacher service on SGLang's official image: SGLang serves the model on the node's
# GPUs; opd-teacher fronts it with /v1/score (input checks, span alignment, session
# routing keys, metrics). Not built in CI. Build from the repository root:
#   docker build -f docker/teacher.Dockerfile -t opd-teacher .
# `latest` follows SGLang's newest release; pin the base for a reproducible image, e.g. the
# release slime's stable image is built on:
#   docker build -f docker/teacher.Dockerfile \
#       --build-arg SGLANG_IMAGE=lmsysorg/sglang:v0.5.15.post1-cu129 -t opd-teacher .
ARG SGLANG_IMAGE=lmsysorg/sglang:latest
FROM ${SGLANG_IMAGE}

WORKDIR /opt/opd
COPY pyproject.toml README.md ./
COPY slime_ext ./slime_ext
COPY rollout ./rollout
COPY sandbox ./sandbox
COPY teacher_server ./teacher_server
COPY launch ./launch
# --no-deps keeps the image's torch and transformers; the service itself needs only these.
RUN pip install --no-cache-dir --no-deps -e . \
    && pip install --no-cache-dir "fastapi>=0.110" "uvicorn>=0.30" "httpx>=0.27" \
        "typer>=0.12" "pydantic>=2.7,<3" "pyyaml>=6.0" "jsonschema>=4.18"
COPY docker/teacher-entrypoint.sh /usr/local/bin/teacher-entrypoint.sh
RUN chmod +x /usr/local/bin/teacher-entrypoint.sh

ENV MODEL_PATH=/models/teacher \
    TP_SIZE=8 \
    SGLANG_PORT=30000 \
    PORT=8000 \
    MAX_TOP_K=100
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s \
    CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen(f\"http://127.0.0.1:{os.environ['PORT']}/health\", timeout=4)"]
ENTRYPOINT ["/usr/local/bin/teacher-entrypoint.sh"]
