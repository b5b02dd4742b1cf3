# The trainer image for AMD Instinct nodes (MI300X / MI325X, gfx942): slime's ROCm image
# (rlsys/slime, built from slime's docker/Dockerfile.rocm: ROCm torch, SGLang, Megatron-LM
# at /workspace/Megatron-LM, Ray) plus slime itself where the image lacks it and this
# package; the same hooks as docker/trainer.Dockerfile. Not built in CI. Build from the
# repository root:
#   docker build -f docker/trainer-rocm.Dockerfile -t opd-trainer-rocm .
# `latest` is whatever slime's AMD maintainers pushed last; pin a tag for a reproducible
# image, e.g. the one slime's docker/Dockerfile.rocm names (its SGLang is older than the
# CUDA image's: check it against SLIME_COMMIT before a long run):
#   docker build -f docker/trainer-rocm.Dockerfile -t opd-trainer-rocm \
#       --build-arg BASE=rlsys/slime:slime_ubuntu22.04_rocm6.3.4-patch-numa-patch_sglang0.4.9_megatron-patch_ray2.47.1_apex_torch-memory-saver0.0.8-patch-vim .
ARG BASE=rlsys/slime:latest
FROM ${BASE}

# slime's checkout when the image has none importable: the commit the hooks are written
# against (the commit `make slime` installs for the tests: tests/slime_cpu.py SLIME_COMMIT).
ARG SLIME_COMMIT=624b824a898ab0ec1fcb4d373004c7f3852bf515
ARG SLIME_REPO=https://github.com/THUDM/slime.git
# Image packages pip may replace (space-separated names); empty keeps every one as it is.
ARG UNPINNED=""
# The same hooks and flags as docker/trainer.Dockerfile.
ENV OPD_SLIME_HOOKS="slime_ext.slime.generate.generate slime_ext.slime.reward.reward slime_ext.slime.reward.post_process_rewards slime_ext.slime.loss.loss slime_ext.slime.metrics.log_rollout slime_ext.slime.sft_rollout.generate_rollout slime_ext.slime.oprd.post_process_rewards slime_ext.slime.oprd.advantages" \
    RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES=1

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# slime at /root/slime and Megatron-LM reachable at /root/Megatron-LM, where the CUDA image
# has them, so the launch defaults (cluster.slime_dir, cluster.megatron_dir) hold on both.
RUN if ! python3 -c "import slime" 2>/dev/null; then \
        git clone --quiet "$SLIME_REPO" /root/slime \
        && git -C /root/slime checkout --quiet "$SLIME_COMMIT" \
        && pip install --no-cache-dir --no-deps -e /root/slime; \
    fi \
    && slime_dir=$(python3 -c "import os, slime; print(os.path.dirname(os.path.dirname(slime.__file__)))") \
    && if [ ! -e /root/slime ]; then ln -s "$slime_dir" /root/slime; fi \
    && test -f /root/slime/train.py \
    && megatron_dir=$(python3 -c "import os, megatron.core as m; print(os.path.dirname(os.path.dirname(os.path.dirname(m.__file__))))") \
    && if [ ! -e /root/Megatron-LM ]; then ln -s "$megatron_dir" /root/Megatron-LM; fi

COPY pyproject.toml README.md /tmp/opd/
COPY slime_ext /tmp/opd/slime_ext
COPY rollout /tmp/opd/rollout
COPY sandbox /tmp/opd/sandbox
COPY teacher_server /tmp/opd/teacher_server
COPY launch /tmp/opd/launch
COPY docker/install-opd.sh /tmp/install-opd.sh
RUN bash /tmp/install-opd.sh /tmp/opd \
    && rm -rf /tmp/opd /tmp/install-opd.sh

WORKDIR /root/slime
