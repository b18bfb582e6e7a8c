"""TRL environment classes (--environment_factory): a TRL-style class file (tests/environments/trl_guess_env.py) runs
unchanged; its tools are offered through Qwen's real chat template, the model's Hermes tool calls run on the
instance, and the tool results are the ids TRL's own `_get_tool_suffix_ids` (trl 1.16, called here) computes.

The engine is a stand-in (ScriptedToolEngine): no tiny model writes a tool call on cue. It answers each call with a
scripted reply, as ids with made-up log-probs, through the real gateway; the 2-rank run in test_factory_e2e.py
samples from a real model."""

from __future__ import annotations

import copy
import json
import os
from types import SimpleNamespace

import pytest
import trl
from trl.trainer.grpo_trainer import GRPOTrainer

from helpers import ScriptedToolEngine
from rlrun.cli.parser import parse_args
from rlrun.data.prompts import PromptRecord, Prompts
from rlrun.environments.factory import build_factory_episodes, tool_suffix, tools_of
from rlrun.runtime.errors import ConfigError
from trl_guess_env import GuessEnv

HERE = os.path.dirname(os.path.abspath(__file__))
QWEN25 = open(os.path.join(os.path.dirname(trl.__file__), "chat_templates", "qwen2_5.jinja")).read()
CALL = '<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call><|im_end|>'
ASK = [{"role": "user", "content": "Find the secret number."}]


@pytest.fixture(scope="module")
def tok(qwen_tokenizer):
    """Qwen's tokenizer with Qwen2.5's tool-calling template (TRL's copy of it: TRL uses it as is, being
    prefix-preserving; the tokenizer's own Qwen3 template is checked on its own below)."""
    tok = copy.deepcopy(qwen_tokenizer)
    tok.chat_template = QWEN25
    return tok


def _source(tok, *extra: str):
    cfg = parse_args(["--environment_factory", f"{HERE}/trl_guess_env.py:GuessEnv", "--generate_max_len", "400",
                      "--prompt_max_len", "400", "--agent_timeout", "3", *extra]).config
    return build_factory_episodes(cfg.agent, cfg.generation, {}, tok, None, "tiny", 0)


def _prompts(tok, answers: list[str | None], ask=ASK) -> Prompts:
    records = [PromptRecord(prompt=ask, columns={"prompt": ask} | ({} if a is None else {"answer": a}))
               for a in answers]
    ids = [tok.apply_chat_template(ask, add_generation_prompt=True, tokenize=True, return_dict=False)] * len(answers)
    return Prompts([f"find {a}" for a in answers], ids, records, 0, 0)


def _trl_suffix(tok, messages):
    stub = SimpleNamespace(processing_class=tok, _tokenizer=tok, _is_vlm=False, chat_template=None,
                           chat_template_kwargs={})
    return GRPOTrainer._get_tool_suffix_ids(stub, messages)


def test_a_trl_class_runs_unchanged_and_its_rows_are_trl_s_ids(tok):
    """Two guesses then an answer: the prompt is the conversation with reset's text appended and the tools shown, as
    TRL renders it; between the replies sit exactly TRL's tool-result ids (mask 0, log-prob 0); the replies keep the
    engine's ids and log-probs; get_reward() is the reward; the instances are reused from step to step."""
    replies = [CALL.format(name="guess", args='{"number": 3}'), CALL.format(name="guess", args='{"number": 7}'),
               "It is 7.<|im_end|>"]
    source = _source(tok)
    engine = ScriptedToolEngine(tok, replies, replies)
    prompts = _prompts(tok, ["7", "3", "5"])
    eps = source.episodes(engine, prompts, [0, 1, 2], prompts.ids, seed=1)
    assert eps.stats["failed"] == 0 and eps.stats["turns"] == 9 and eps.stats["tool_calls"] == 6
    assert eps.stats["tool_failures"] == 0
    env = GuessEnv()
    first = [{"role": "user", "content": ASK[0]["content"] + " Use the guess tool."}]
    trl_prompt = tok.apply_chat_template(first, tools=tools_of(env), add_generation_prompt=True, tokenize=True,
                                         return_dict=False)
    said = {"7": ["Higher.", "Correct!"], "3": ["Correct!", "Lower."], "5": ["Higher.", "Lower."]}
    for k, answer in enumerate(["7", "3", "5"]):
        assert eps.prompts[k] == trl_prompt
        r = [tok.encode(x, add_special_tokens=False) for x in replies]
        s = [_trl_suffix(tok, [{"role": "tool", "name": "guess", "content": text}]) for text in said[answer]]
        assert eps.responses[k] == r[0] + s[0] + r[1] + s[1] + r[2]
        assert eps.action_masks[k] == [1] * len(r[0]) + [0] * len(s[0]) + [1] * len(r[1]) + [0] * len(s[1]) + \
            [1] * len(r[2])
        lps = [[-0.01 * (j + 1) for j in range(len(x))] for x in r]
        assert eps.log_probs[k] == lps[0] + [0.0] * len(s[0]) + lps[1] + [0.0] * len(s[1]) + lps[2]
    assert eps.rewards.tolist() == [0.5, 0.5, 0.0]
    pool = list(source.pool)
    source.episodes(engine, prompts, [0, 1], prompts.ids[:2], seed=2)
    assert source.pool == pool  # construct once, reset often


def test_tool_errors_are_the_model_s_to_read_and_a_bad_reset_or_a_hang_fails_the_episode(tok):
    """A call of a tool that does not exist and one whose arguments break it reach the model as TRL's
    {'error': ...}; --max_turns 3 ends an episode that keeps calling (its third call is not run); a reset that raises, or that outlives
    --agent_timeout, fails its episode (no action trained), counted."""
    replies = [CALL.format(name="guess", args='{"number": 3}')] * 3
    bad = [CALL.format(name="shout", args="{}"), CALL.format(name="guess", args='{"number": "x"}'), "?"]
    source = _source(tok, "--max_turns", "3", "--agent_timeout", "1")
    engine = ScriptedToolEngine(tok, replies, bad)
    asks = [ASK, [{"role": "user", "content": "Use the bad tool."}]]
    prompts = Prompts(["a", "b", "c", "d"], [[1]] * 4, [
        *_prompts(tok, ["7"]).records, *_prompts(tok, ["7"], asks[1]).records, *_prompts(tok, [None]).records,
        *_prompts(tok, ["sleep"]).records], 0, 0)
    eps = source.episodes(engine, prompts, [0, 1, 2, 3], [[1]] * 4, seed=1)
    assert eps.stats["failed"] == 2 and eps.stats["tool_failures"] == 2 and eps.stats["turns"] == 6
    text = tok.decode(eps.responses[1])
    assert "{'error': 'Tool shout not found.'}" in text
    assert "{'error': \"'<' not supported between instances of 'str' and 'int'\"}" in text
    kept = tok.decode(eps.responses[0])
    assert kept.count("<tool_call>") == 3 and kept.count("<tool_response>") == 2
    assert sum(eps.action_masks[2]) == 0 and sum(eps.action_masks[3]) == 0


def test_qwen3_s_own_template_gives_the_tool_turn_trl_s_training_template_gives(qwen_tokenizer):
    """The tokenizer's own template (Qwen3: a past turn loses its empty think block, so TRL swaps in a training
    template) still gives the text after the tool-call turn, and the end marker first when the reply lacks it."""
    messages = [{"role": "tool", "name": "guess", "content": "Higher."}]
    after = "\n<|im_start|>user\n<tool_response>\nHigher.\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert tool_suffix(qwen_tokenizer, messages, True, {}) == after
    assert tool_suffix(qwen_tokenizer, messages, False, {}) == "<|im_end|>" + after


@pytest.mark.parametrize(("spec", "message"), [
    ("trl_bad_envs.py", "names no class"),
    ("no_such_module_xyz:Env", "module no_such_module_xyz does not import"),
    (f"{HERE}/trl_bad_envs.py:Missing", "defines no class or function Missing"),
    (f"{HERE}/trl_bad_envs.py:NoReset", "NoReset defines no reset"),
    (f"{HERE}/trl_bad_envs.py:UndocumentedTool", "tool guess has no schema"),
    (f"{HERE}/trl_bad_envs.py:NoReward", "defines no get_reward"),
    (f"{HERE}/trl_bad_envs.py:BrokenConstructor", "making an instance raised RuntimeError: no database"),
])
def test_a_class_that_breaks_trl_s_contract_is_one_clear_error(tok, spec, message):
    cfg = parse_args(["--environment_factory", spec]).config
    with pytest.raises(ConfigError, match=message):
        build_factory_episodes(cfg.agent, cfg.generation, {}, tok, None, "tiny", 0)


def test_reset_gets_the_dataset_s_columns_as_trl_passes_them(tmp_path, tok):
    """--prompt_data in TRL's conversational format with extra columns: with --environment_factory the records keep
    every column (images aside), which reset(**row) receives as TRL passes the dataset row."""
    from rlrun.data.prompts import prompt_spec
    from rlrun.plan.preflight import ppo_prompts

    rows = [{"prompt": [{"role": "user", "content": "Find it."}], "answer": "7", "meta": {"level": 2}},
            {"prompt": [{"role": "user", "content": "Find it."}], "answer": "3", "meta": {"level": 1}}]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    flags = ["--prompt_data", str(data), "--input_key", "prompt", "--prompt_max_len", "400"]
    cfg = parse_args([*flags, "--environment_factory", f"{HERE}/trl_guess_env.py:GuessEnv"]).config
    assert [r.columns for r in ppo_prompts(cfg, tok, prompt_spec(cfg.data, 0)).records] == rows
    plain = parse_args([*flags, "--remote_rm_url", "demo"]).config
    assert all(r.columns is None for r in ppo_prompts(plain, tok, prompt_spec(plain.data, 0)).records)  # only here
