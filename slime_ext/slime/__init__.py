"""Hooks slime loads by dotted path; nothing else in the project imports slime.

    --custom-generate-function-path     slime_ext.slime.generate.generate
    --custom-rm-path                    slime_ext.slime.reward.reward
    --custom-reward-post-process-path   slime_ext.slime.reward.post_process_rewards
                                        (OPRD: slime_ext.slime.oprd.post_process_rewards)
    --custom-advantage-function-path    slime_ext.slime.oprd.advantages  (OPRD)
    --loss-type custom_loss
    --custom-loss-function-path         slime_ext.slime.loss.loss
    --rollout-function-path             slime_ext.slime.sft_rollout.generate_rollout  (SFT/SSD data)
    --custom-rollout-log-function-path  slime_ext.slime.metrics.log_rollout
    --custom-config-path                a YAML with `opd_job_config: /path/to/job.yaml`

The calling conventions are those of THUDM/slime at the commit the tests run
(tests/slime_cpu.py SLIME_COMMIT; `make slime` installs it).
"""
