"""The one redaction (rlrun.runtime.secrets) against the secret shapes people put in flags, URLs and files."""

from __future__ import annotations

import json

import pytest

from rlrun.cli.parser import parse_args
from rlrun.config.fields import redacted
from rlrun.runtime.secrets import MASK, is_secret_name, redact_text, redact_url, redact_value

SECRET = "s3cr3tValue0123456789abcdefXYZ"

# (text holding SECRET, what must survive around it)
SHAPES = [
    (f"http://user:{SECRET}@rm.internal:5000/reward", "http://<redacted>@rm.internal:5000/reward"),
    (f"https://rm.example/score?api_key={SECRET}&model=x", "https://rm.example/score?<redacted>"),
    (f"https://rm.example/score#{SECRET}", "https://rm.example/score#<redacted>"),
    (f"http://[::1]:8000/retrieve?token={SECRET}", "http://[::1]:8000/retrieve?<redacted>"),
    (f"see https://h/x?token={SECRET}, then retry", "see https://h/x?<redacted>, then retry"),
    (f"hf_{SECRET}", MASK),
    (f"sk-proj-{SECRET}", MASK),
    (f"sk-ant-{SECRET}", MASK),
    (f"ghp_{SECRET}", MASK),
    (f"github_pat_{SECRET}", MASK),
    (f"xoxb-{SECRET}", MASK),
    ("AKIAIOSFODNN7EXAMPLE", MASK),
    (f"eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.{SECRET}", MASK),
    ("0123456789abcdef0123456789abcdef01234567", MASK),  # a W&B API key: 40 hex digits
    (f"Authorization: Bearer {SECRET}", "Authorization: Bearer <redacted>"),
    (f"api_key={SECRET}", "api_key=<redacted>"),
    (f'{{"token": "{SECRET}"}}', '{"token": "<redacted>"}'),
    (f"password: {SECRET}", "password: <redacted>"),
    (f"--hf_token={SECRET}", "--hf_token=<redacted>"),
    (f"WANDB_API_KEY={SECRET} torchrun", "WANDB_API_KEY=<redacted> torchrun"),
]


@pytest.mark.parametrize("text, kept", SHAPES)
def test_every_secret_shape_is_masked(text, kept):
    out = redact_text(text)
    assert SECRET not in out and "AKIAIOSFODNN7EXAMPLE" not in out and "0123456789abcdef0123" not in out
    assert out == kept


@pytest.mark.parametrize("text", [
    "http://127.0.0.1:8000/retrieve", "/data/prompts.jsonl", "Qwen/Qwen2.5-7B-Instruct", "the authentication failed",
    "meta-llama/Llama-3-8b", "gsm8k@train", "step_00000003",
])
def test_ordinary_text_is_left_alone(text):
    assert redact_text(text) == text


def test_urls_keep_what_locates_the_service():
    assert redact_url("https://rm.example:8443/score") == "https://rm.example:8443/score"
    assert redact_url("http://host:99999/x") == "http://<redacted>"  # unparsable: nothing guessed


def test_setting_names_that_hold_secrets():
    for name in ("hf_token", "api_key", "wandb_api_key", "aws_secret_access_key", "db_password"):
        assert is_secret_name(name) and redact_value(name, "x") == MASK
    for name in ("max_tokens_per_turn", "input_key", "label_key", "tokenizer_chat_template", "pad_token_id"):
        assert not is_secret_name(name), name  # a token count, a dataset key, a template: not secrets
    assert redact_value("max_tokens_per_turn", 5) == 5 and redact_value("input_key", "prompt") == "prompt"
    assert redact_value("remote_rm_url", [f"http://a/b?k={SECRET}"]) == ["http://a/b?<redacted>"]


def test_the_stored_config_holds_no_secret():
    """What checkpoints, config files and trackers store: rlrun.config.fields.redacted of the parsed flags."""
    config = parse_args(["--remote_rm_url", f"http://u:{SECRET}@rm:5000/reward?api_key={SECRET}",
                         "--use_wandb", "0123456789abcdef0123456789abcdef01234567",
                         "--retriever_url", f"http://ret:8000/retrieve?token={SECRET}"]).config
    text = json.dumps(redacted(config))
    assert SECRET not in text and "0123456789abcdef" not in text
    stored = redacted(config)
    assert stored["reward"]["remote_rm_url"] == "http://<redacted>@rm:5000/reward?<redacted>"
    assert stored["logging"]["use_wandb"] == MASK
