#!/usr/bin/env bash
# Test and rehearsal set-up: Megatron-LM's training package (`megatron.training`, with the
# `legacy`, `rl` and `post_training` packages it imports), which slime's train.py imports
# and the megatron-core wheel does not ship, into the virtualenv beside that wheel, plus
# triton, which it imports at top level. numpy stays 2.x (datasets and pyarrow need it):
# slime's numpy-1 assert is met by the CPU runtime (slime_ext/cpu_runtime), which says why.
#   tests/install_megatron_lm.sh SOURCE VENV
# SOURCE: a .tar.gz of Megatron-LM (a `git archive` holding megatron/training), a
# Megatron-LM checkout, or a git URL with a ref (git+https://...@TAG). Nothing of it is
# copied into the project: it is extracted under VENV/src/megatron-lm, and a .pth file puts
# that folder on the path (`megatron` is a namespace package in the megatron-core wheel,
# so `megatron.training` merges in beside `megatron.core`).
# Never fails the caller: where no source is reachable the whole-job tests skip (fail
# under CI) and say how to provide one.
set -uo pipefail
source_spec=${1:?usage: install_megatron_lm.sh SOURCE VENV}
venv=${2:?usage: install_megatron_lm.sh SOURCE VENV}
stamp="$venv/.megatron-lm-installed"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$source_spec" ]; then
    exit 0
fi
target="$venv/src/megatron-lm"
skip() {
    echo "Megatron-LM: $1; the whole-job tests will skip (set MEGATRON_LM_SOURCE to a" \
        "Megatron-LM .tar.gz, checkout or git URL at tag core_v0.16.1)" >&2
    exit 0
}
rm -rf "$target" && mkdir -p "$target"
case "$source_spec" in
    *.tar.gz | *.tgz)
        [ -f "$source_spec" ] || skip "$source_spec not found"
        tar -xzf "$source_spec" -C "$target" --strip-components=1 || skip "cannot extract $source_spec"
        ;;
    git+*)
        url=${source_spec#git+}
        ref=${url##*@}
        url=${url%@*}
        git clone --quiet --depth 1 --branch "$ref" "$url" "$target.clone" ||
            skip "cannot clone $url at $ref"
        mkdir -p "$target/megatron"
        for package in training legacy rl post_training; do
            cp -r "$target.clone/megatron/$package" "$target/megatron/" || skip "no megatron/$package at $ref"
        done
        cp "$target.clone/LICENSE" "$target/"
        rm -rf "$target.clone"
        ;;
    *)
        [ -d "$source_spec/megatron/training" ] || skip "$source_spec holds no megatron/training"
        mkdir -p "$target/megatron"
        for package in training legacy rl post_training; do
            cp -r "$source_spec/megatron/$package" "$target/megatron/"
        done
        ;;
esac
[ -d "$target/megatron/training" ] || skip "$source_spec holds no megatron/training"
# the megatron-core wheel owns megatron/__init__.py (none here): only the subpackages merge
rm -f "$target/megatron/__init__.py"
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$(cd "$target" && pwd)" >"$site/megatron_lm_training.pth"
"$venv/bin/pip" install --quiet --disable-pip-version-check triton || skip "cannot install triton"
echo "$source_spec" >"$stamp"
echo "Megatron-LM's training package installed from $source_spec"
