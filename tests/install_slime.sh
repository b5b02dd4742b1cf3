#!/usr/bin/env bash
# Test set-up: install THUDM/slime (not on PyPI) into the virtualenv WITHOUT its GPU
# dependencies, plus the pure-Python packages its data path imports, for the real-slime
# tests (tests/test_slime_real.py; the CPU import stand-ins are in tests/slime_cpu.py).
#   tests/install_slime.sh SOURCE VENV
# SOURCE: a slime .tar.gz, a slime checkout, or a pip VCS URL (git+https://...@COMMIT).
# Never fails the caller: where no source is reachable the real-slime tests skip and say
# how to provide one.
set -uo pipefail
source_spec=${1:?usage: install_slime.sh SOURCE VENV}
venv=${2:?usage: install_slime.sh SOURCE VENV}
stamp="$venv/.slime-installed"
FLA_CORE=0.6.0
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$source_spec fla-core==$FLA_CORE" ]; then
    exit 0
fi
pip=("$venv/bin/pip" install --quiet --disable-pip-version-check)
case "$source_spec" in
    *.tar.gz | *.tgz)
        if [ ! -f "$source_spec" ]; then
            echo "slime: $source_spec not found; the real-slime tests will skip" >&2
            exit 0
        fi
        rm -rf "$venv/src/slime" && mkdir -p "$venv/src/slime"
        tar -xzf "$source_spec" -C "$venv/src/slime" --strip-components=1 || exit 0
        target="$venv/src/slime"
        ;;
    git+*) target="$source_spec#egg=slime" ;;
    *) target=$source_spec ;;
esac
# editable: slime's tools/ (the checkpoint converters) stay beside the package
if ! "${pip[@]}" --no-deps --editable "$target"; then
    echo "slime: could not install from $source_spec; the real-slime tests will skip" \
        "(set SLIME_SOURCE to a slime .tar.gz, checkout or git URL)" >&2
    exit 0
fi
# flash-linear-attention's core (pure Python; its Triton kernels do not run on a CPU): slime's
# Qwen3.5 / Qwen3-Next layers import their modules from it (tests/test_megatron_hybrid.py)
"${pip[@]}" pylatexenc pybase64 einops "fla-core==$FLA_CORE" || exit 0
echo "$source_spec fla-core==$FLA_CORE" >"$stamp"
echo "slime installed from $source_spec"
