"""One run of any trainer, start to teardown (skeleton): the launcher's environment, the plan and --dry_run, device
and backend, the files read before the first collective, output checks, the default group, the trainer's build, the
resume, the steps with their evaluations, metrics and checkpoints, the export, the summary and teardown, and the
one-line failure of a rank. rlrun.ppo, sft, rm and dpo each supply only what differs.

May import plan/ and every folder below it; rl/ and supervised/ implement its `Trainer`.
"""
