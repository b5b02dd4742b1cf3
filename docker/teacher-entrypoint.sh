#!/usr/bin/env bash
# Start SGLang on localhost, wait until it answers, then serve /v1/score in front of it.
# OPD_TEACHER_API_KEY (if set) is required as a bearer token by opd-teacher.
set -euo pipefail
python3 -m sglang.launch_server --model-path "$MODEL_PATH" --tp-size "$TP_SIZE" \
    --host 127.0.0.1 --port "$SGLANG_PORT" &
sglang_pid=$!
until curl -sf "http://127.0.0.1:${SGLANG_PORT}/health" >/dev/null; do
    kill -0 "$sglang_pid" 2>/dev/null || { echo "SGLang exited during start-up" >&2; exit 1; }
    sleep 5
done
exec opd-teacher serve --backend sglang --model "$MODEL_PATH" \
    --sglang-url "http://127.0.0.1:${SGLANG_PORT}" --host 0.0.0.0 --port "$PORT" \
    --max-top-k "$MAX_TOP_K"
