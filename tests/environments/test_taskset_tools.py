"""A tool-using verifiers 0.4 taskset (tests/environments/lookup_taskset: a Toolset MCP server per rollout, as `vf
init --add-tool` lays one out) through rlrun's harness: the real verifiers starts the tool server (a subprocess on
this machine, offline), rlrun-chat offers its tools and runs the model's tool calls on it, verifiers records each call
through its interception server, and the row is one branch: reply, tool result (mask 0), reply.

The engine is a stand-in (helpers.ScriptedToolEngine: no tiny model writes a tool call on cue), behind the real
gateway, on Qwen's real tokenizer (verifiers renders the chat and parses the tool call from its ids)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import trl

from helpers import ScriptedToolEngine
from rlrun.cli.parser import parse_args
from rlrun.environments.tasksets import build_taskset_episodes
from rlrun.plan.preflight import ppo_prompts

HERE = Path(__file__).resolve().parent
CALL = '<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call><|im_end|>'


@pytest.fixture(scope="module")
def qwen25(qwen_vocab_model, tmp_path_factory):
    """Qwen's tokenizer with Qwen2.5's chat template (TRL's copy): renderers' default renderer renders through the
    template, and Qwen3's (the tokenizer's own) fails on a tool-call reply without text."""
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("qwen25_tokenizer")
    tok = AutoTokenizer.from_pretrained(qwen_vocab_model)
    tok.chat_template = (Path(trl.__file__).parent / "chat_templates" / "qwen2_5.jinja").read_text()
    tok.save_pretrained(folder)
    return folder, tok


def test_a_tool_taskset_s_calls_run_on_its_mcp_server_and_the_row_is_one_branch(qwen25, monkeypatch):
    folder, qwen_tokenizer = qwen25
    monkeypatch.syspath_prepend(str(HERE))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))  # its server's
    cfg = parse_args(["--env_id", "lookup_taskset", "--generate_max_len", "200", "--prompt_max_len", "400",
                      "--max_turns", "3", "--agent_timeout", "60"]).config
    prompts = ppo_prompts(cfg, qwen_tokenizer, None)
    source = build_taskset_episodes(cfg.agent, cfg.generation, qwen_tokenizer, "tiny", str(folder), 0, 3)
    replies = [CALL.format(name="lookup_toolset_lookup", args='{"color": "red"}'), "The code is 4417.<|im_end|>"]
    engine = ScriptedToolEngine(qwen_tokenizer, replies, replies)
    try:
        eps = source.episodes(engine, prompts, [0, 1, 2], [prompts.ids[i] for i in range(3)], seed=1)
    finally:
        source.close()
    assert eps.stats["failed"] == 0 and eps.stats["calls_off_branch"] == 0 and eps.stats["turns"] == 6
    tok = qwen_tokenizer
    for k in range(3):
        response, mask = eps.responses[k], eps.action_masks[k]
        first, second = (tok.encode(r, add_special_tokens=False) for r in replies)
        assert response[:len(first)] == first and response[-len(second):] == second
        between = response[len(first):-len(second)]
        assert mask == [1] * len(first) + [0] * len(between) + [1] * len(second)
        assert "<tool_response>\n4417\n</tool_response>" in tok.decode(between)  # the MCP server's answer
    assert eps.rewards.tolist() == [1.0, 0.0, 0.0]  # red's code is 4417; blue's is not, green has none
