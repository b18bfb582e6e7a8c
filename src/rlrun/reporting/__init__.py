"""What a run tells the user: the metrics sink (metrics: metrics.jsonl, wandb, tensorboard), the per-step progress
line or bar (progress), the start-up and end-of-run report (run_report: where everything goes, the resolved settings
as config.yaml (run_config), the summary (summary) and the PNG of the main curves (curves)).

May import config/ and runtime/.
"""
