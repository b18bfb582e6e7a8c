"""Multi-turn verifiers 0.4 tasksets through rlrun's harness (rlrun-chat). A tool-using taskset
(tests/environments/lookup_taskset: a Toolset MCP server per rollout, as `vf init --add-tool` lays one out): the real
verifiers starts the tool server (a subprocess on this machine, offline), rlrun-chat offers its tools and runs the
model's tool calls on it, verifiers records each call through its interception server, and the row is one branch:
reply, tool result (mask 0), reply. A taskset with a multi-turn env of its own (tests/environments/chars_game_taskset,
as verifiers' TextArena): its seat gets rlrun's harness and its later turns resume the conversation.

The engine is a stand-in (helpers.ScriptedToolEngine: no tiny model writes a tool call, or only valid text, on cue),
behind the real gateway; verifiers renders each chat and parses the tool calls from the ids itself."""

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


def test_a_taskset_with_its_own_multi_turn_env_trains_its_player_s_one_branch(monkeypatch):
    """tests/environments/chars_game_taskset exports an Env with seat `player` (as verifiers' TextArena does): rlrun
    puts its harness in that seat, the env's later turns resume the conversation, and each episode's row is the
    player's one branch: reply, the env's "Once more." in the template's turn markers (mask 0), reply, ... (2 or 3
    rounds by task); the reward is what the env recorded. (Replies that are not valid text would start new branches:
    verifiers re-renders a resumed conversation from its text, so the scripted engine writes plain digits.)"""
    from rlrun.models.tiny import build_byte_tokenizer

    monkeypatch.syspath_prepend(str(HERE))
    tok = build_byte_tokenizer()
    cfg = parse_args(["--env_id", "chars_game_taskset", "--generate_max_len", "120"]).config
    prompts = ppo_prompts(cfg, tok, None)
    source = build_taskset_episodes(cfg.agent, cfg.generation, tok, "tiny", None, 0, cfg.train.max_samples)
    replies = ["123<|eos|>", "45x<|eos|>", "6789<|eos|>"]
    engine = ScriptedToolEngine(tok, replies, replies, turn="Assistant:", end="<|eos|>")
    try:
        eps = source.episodes(engine, prompts, [0, 1, 2, 3], [prompts.ids[i] for i in range(4)], seed=2)
    finally:
        source.close()
    assert eps.stats["failed"] == 0 and eps.stats["calls_off_branch"] == 0
    assert eps.stats["turns"] == 2 + 2 + 3 + 2 and eps.stats["metric/rounds"] == 9
    bridge = "\nUser: Once more.\nAssistant: "
    for k, rounds in enumerate([2, 2, 3, 2]):
        assert tok.decode(eps.responses[k]) == bridge.join(replies[:rounds])
        chunks = [tok.encode(r, add_special_tokens=False) for r in replies[:rounds]]
        gap = [0] * len(tok.encode(bridge, add_special_tokens=False))
        expected = [1] * len(chunks[0])
        for chunk in chunks[1:]:
            expected += gap + [1] * len(chunk)
        assert eps.action_masks[k] == expected
    # digits rows: 1 + 2/3 (+ 1); letters rows: 0 + 1/3
    assert eps.rewards.tolist() == pytest.approx([1 + 2 / 3, 1 / 3, 1 + 2 / 3 + 1, 1 / 3])
