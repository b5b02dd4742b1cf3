# The trainer image: slime's image (torch with CUDA, SGLang, Megatron-LM at
# /root/Megatron-LM, slime at /root/slime, Ray) plus this package, whose hooks slime loads
# by dotted path (OPD_SLIME_HOOKS below; README.md "Run inside slime"). Every node of a
# cluster job (Ray head and workers) runs it. Not built in CI: slime's image is not
# reachable offline. Build from the repository root:
#   docker build -f docker/trainer.Dockerfile -t opd-trainer .
# `latest` follows slime's newest CUDA 12 image; pin a versioned tag for a reproducible
# image (<slime's docker/version.txt>-cu129, or -cu130 for Blackwell), e.g. the one
# current at the slime commit the hooks are written against (624b824a):
#   docker build -f docker/trainer.Dockerfile \
#       --build-arg BASE=slimerl/slime:nightly-dev-20260810a-cu129 -t opd-trainer .
ARG BASE=slimerl/slime:latest
FROM ${BASE}

# What slime is told, one flag per hook:
#   --custom-generate-function-path     slime_ext.slime.generate.generate
#   --custom-rm-path                    slime_ext.slime.reward.reward
#   --custom-reward-post-process-path   slime_ext.slime.reward.post_process_rewards
#   --loss-type custom_loss --custom-loss-function-path slime_ext.slime.loss.loss
#   --custom-rollout-log-function-path  slime_ext.slime.metrics.log_rollout
#   --rollout-function-path             slime_ext.slime.sft_rollout.generate_rollout (SFT/SSD)
#   OPRD: --custom-reward-post-process-path slime_ext.slime.oprd.post_process_rewards
#         --custom-advantage-function-path  slime_ext.slime.oprd.advantages
# The build loads each one with slime's loader, so a hook that does not import fails here.
ENV OPD_SLIME_HOOKS="slime_ext.slime.generate.generate slime_ext.slime.reward.reward slime_ext.slime.reward.post_process_rewards slime_ext.slime.loss.loss slime_ext.slime.metrics.log_rollout slime_ext.slime.sft_rollout.generate_rollout slime_ext.slime.oprd.post_process_rewards slime_ext.slime.oprd.advantages"
# Image packages pip may replace (space-separated names); empty keeps every one as it is.
ARG UNPINNED=""

COPY pyproject.toml README.md /tmp/opd/
COPY slime_ext /tmp/opd/slime_ext
COPY rollout /tmp/opd/rollout
COPY sandbox /tmp/opd/sandbox
COPY teacher_server /tmp/opd/teacher_server
COPY launch /tmp/opd/launch
COPY docker/install-opd.sh /tmp/install-opd.sh
# A regular (not editable) install: Ray workers import it from site-packages, whatever
# their working directory.
RUN bash /tmp/install-opd.sh /tmp/opd \
    && rm -rf /tmp/opd /tmp/install-opd.sh

# slime's train.py and tools/ are run from here (slime_ext/job/config.py: cluster.slime_dir).
WORKDIR /root/slime
