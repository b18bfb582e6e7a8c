"""OpenEnv's own grader of model endpoints, validate_llm() from openenv 0.10 (run in the OpenEnv lane), rates rlrun's
token gateway `capture_level=tokens`: the level at which OpenEnv's capture proxy can record trainable tokens. It
lists the model, checks prompt_token_ids / token_ids / "token_id:N" log-probs, sends a tool manifest and probes the
log-prob mode; the gateway refuses the temperatures and token counts the run does not sample with, in OpenAI's
"Unsupported value" form, which validate_llm adapts to (it drops the field and says so)."""

from __future__ import annotations

import json
import subprocess

from helpers import SHARP_TEMPERATURE, sharp_native_engine
from openenv_lane import OPENENV_PYTHON, lane_env, needs_openenv
from rlrun.gateway.server import Gateway
from rlrun.gateway.wire import Limits
from rlrun.models.tiny import build_byte_tokenizer

VALIDATE = """
import json, sys
from openenv.core.harness.capture.validate_llm import validate_llm
report = validate_llm(sys.argv[1], "tiny", api_key=sys.argv[2], timeout=60)
print(json.dumps({"capture_level": report.capture_level, "ok": report.ok, "findings": report.findings,
                  "fixes": report.param_fixes, "tools": report.tool_support, "models": report.served_models}))
"""


@needs_openenv
def test_openenvs_validate_llm_rates_the_gateway_tokens():
    gateway = Gateway(Limits("tiny", SHARP_TEMPERATURE, 1.0, 12, 512), build_byte_tokenizer(), answer_timeout=60)
    try:
        proc = subprocess.Popen([str(OPENENV_PYTHON), "-c", VALIDATE, gateway.url, gateway.token], env=lane_env(),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        gateway.serve(sharp_native_engine(), seed=2, version=0, until=lambda: proc.poll() is not None)
        out, err = proc.communicate(timeout=60)
    finally:
        gateway.close()
    assert proc.returncode == 0, err[-2000:]
    report = json.loads(out.strip().splitlines()[-1])
    assert report["capture_level"] == "tokens" and report["ok"], report
    assert report["models"] == ["tiny"]
    assert not [f for f in report["findings"] if f.startswith("[FATAL]")], report["findings"]
    assert "dropped temperature" in report["fixes"], report  # the run's temperature is not the probe's
    assert report["tools"] in ("ok", "no-tool-call", "unknown"), report  # the manifest was taken, not rejected
