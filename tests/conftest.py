"""Shared test setup: offline hub, quiet progress bars, CPU DeepSpeed accelerator."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RLRUN_NO_PROGRESS", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
