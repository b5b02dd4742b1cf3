#!/usr/bin/env bash
# Install opd (the source tree in $1) into a trainer image without changing what the image
# already has, then load every slime hook named in OPD_SLIME_HOOKS with slime's own loader.
#
# Every distribution installed in the image is pinned at its installed version through a
# constraints file, so pip adds only what is missing (wandb-workspaces, math-verify,
# swebench, docker, ...) and stops with a resolver error, instead of replacing torch,
# SGLang, Megatron or transformers, when one of our requirements conflicts with the image.
# UNPINNED (distribution names, space-separated) lifts the pin of those, at your own risk.
set -euo pipefail

source_dir=${1:?usage: install-opd.sh SOURCE_DIR}
constraints=$(mktemp --suffix=.txt)
trap 'rm -f "$constraints"' EXIT

pip list --format=freeze --exclude opd >"$constraints"
for name in ${UNPINNED:-}; do
    # distribution names compare case-insensitively, with runs of - _ . equal
    pattern=$(printf '%s' "$name" | sed -E 's/[-_.]+/[-_.]+/g')
    grep -viE "^${pattern}==" "$constraints" >"$constraints.kept" || true
    mv "$constraints.kept" "$constraints"
done
pip install --no-cache-dir --constraint "$constraints" "$source_dir"

python3 - <<'EOF'
import os

from slime.utils.misc import load_function

for path in os.environ["OPD_SLIME_HOOKS"].split():
    if not callable(load_function(path)):
        raise SystemExit(f"slime hook {path} is not callable")
    print(f"slime hook {path}: loads")
EOF
