"""What a run tells the user: the metrics sink and the per-step progress line or bar (metrics: metrics.jsonl,
wandb, tensorboard), the start-up and end-of-run report with the resolved settings as config.yaml (run_report), and
the summary and the PNG of the main curves (summary), and the run while it runs: throughput and MFU, health lines,
the Prometheus endpoint (live).

May import config/ and runtime/.
"""
