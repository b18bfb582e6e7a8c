"""What a run tells the user while it trains: the metrics sink (metrics: metrics.jsonl, wandb, tensorboard)
and the per-step progress line or bar (progress).

May import config/ and runtime/.
"""
