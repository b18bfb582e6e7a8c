"""--agent_command's episodes on one engine rank, in process: real agent programs (the OpenAI SDK, subprocesses),
the real gateway over HTTP and rlrun's native engine. The training row must be the session's ids, not the text the
program saw: the first call's prompt, each call's sampled ids as actions with the engine's log-probs, the ids the
program added between calls as observations (mask 0). Failures train nothing and are counted; most failing ends the
run with one line."""

from __future__ import annotations

import json
import sys
import time

import pytest
import torch

from helpers import SHARP_CAP as CAP
from helpers import SHARP_TEMPERATURE as TEMPERATURE
from helpers import hf_log_probs
from helpers import sharp_native_engine as tiny_engine
from rlrun.data.prompts import PromptRecord, Prompts
from rlrun.environments.programs import ProgramEpisodes, branch_row, parse_reward
from rlrun.environments.rows import EpisodeLimits
from rlrun.gateway.server import Gateway, Recorded
from rlrun.gateway.wire import Call, Completion, Limits
from rlrun.models.tiny import build_byte_tokenizer
from rlrun.runtime.errors import AgentError

TOK = build_byte_tokenizer()

OBSERVATION = [10, 84, 111, 111, 108, 58, 32]  # ids a tool result would add (the program's own)

# Two turns with the OpenAI SDK: a chat request, then a completion that extends the conversation's ids verbatim
# with the observation (token in, token out), as verifiers' renderers and prime-rl's clients do.
SDK_AGENT = f"""
import json, os, sys
import openai
row = json.loads(sys.stdin.readline())
client = openai.OpenAI(max_retries=0, timeout=60)
model = os.environ["OPENAI_MODEL"]
first = client.chat.completions.create(model=model, messages=[{{"role": "user", "content": row["prompt"]}}],
                                       logprobs=True, max_tokens=6, extra_body={{"return_token_ids": True}})
ids = first.model_extra["prompt_token_ids"] + first.choices[0].model_extra["token_ids"] + {OBSERVATION}
second = client.completions.create(model=model, prompt=ids, max_tokens=5, extra_body={{"return_token_ids": True}})
text = first.choices[0].message.content + second.choices[0].text
print("chatter the trainer ignores")
print(json.dumps({{"reward": sum(c.isdigit() for c in text) / max(1, len(text)) + len(row["label"])}}))
"""


def prompts_of(texts: list[str], label: str = "ab") -> Prompts:
    records = [PromptRecord(prompt=t, label=label) for t in texts]
    return Prompts(texts, [TOK.encode(t, add_special_tokens=False) for t in texts], records, 0, 0)


def episodes_for(tmp_path, source: str, *, timeout: float = 60.0, budget: int = 40, reward_fn=None) -> ProgramEpisodes:
    program = tmp_path / "agent.py"
    program.write_text(source)
    limits = EpisodeLimits(response_budget=budget, prompt_max_len=64, timeout_s=timeout, max_concurrency=4)
    served = Limits("tiny", TEMPERATURE, 1.0, CAP, 128)
    return ProgramEpisodes(f"{sys.executable} {program}", limits, TOK, reward_fn,
                           lambda: Gateway(served, TOK, answer_timeout=30))


def test_an_openai_sdk_program_s_two_turns_become_one_row_of_the_engine_s_ids(tmp_path):
    source = episodes_for(tmp_path, SDK_AGENT)
    engine = tiny_engine()
    prompts = prompts_of(["7+5=", "9*9=", "1+1="])
    eps = source.episodes(engine, prompts, [0, 1, 2], prompts.ids, seed=5)
    assert eps.stats["failed"] == 0 and eps.stats["turns"] == 6 and eps.stats["calls_off_branch"] == 0
    for k, text in enumerate(prompts.texts):
        prompt, response, mask = eps.prompts[k], eps.responses[k], eps.action_masks[k]
        assert prompt == TOK.encode(f"User: {text}\nAssistant: ", add_special_tokens=False)  # the chat call's
        n1 = mask.index(0)
        n2 = len(mask) - n1 - len(OBSERVATION)
        assert 1 <= n1 <= 6 and 1 <= n2 <= 5
        assert mask == [1] * n1 + [0] * len(OBSERVATION) + [1] * n2
        assert response[n1:n1 + len(OBSERVATION)] == OBSERVATION
        lps = torch.tensor(eps.log_probs[k])
        assert (lps[n1:n1 + len(OBSERVATION)] == 0).all()
        # the sampled ids' log-probs are the engine's: an HF forward of the whole row gives them back
        full = hf_log_probs(engine.model, TEMPERATURE, prompt, response)
        sampled = torch.tensor(mask, dtype=torch.bool)
        torch.testing.assert_close(lps[sampled], full[sampled], rtol=0, atol=2e-4)
        text_out = TOK.decode([t for t, m in zip(response, mask) if m], skip_special_tokens=True)
        expected = sum(c.isdigit() for c in text_out) / max(1, len(text_out)) + 2
        assert eps.rewards[k].item() == pytest.approx(expected, abs=1e-6)
    assert source.gateway is not None and source.gateway.requests == 6
    source.gateway.close()


FAILING = """
import json, os, sys, time, urllib.request
row = json.loads(sys.stdin.readline())
def call():
    body = json.dumps({"model": os.environ["OPENAI_MODEL"], "messages": [{"role": "user", "content": row["prompt"]}],
                       "max_tokens": 3}).encode()
    req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions", data=body,
                                 headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"],
                                          "Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(req, timeout=30).read())
mode = row["label"]
if mode == "no-call":
    print(json.dumps({"reward": 1.0})); sys.exit(0)
call()
if mode == "crash":
    sys.stderr.write("Traceback ...\\nValueError: the environment broke\\n"); sys.exit(3)
if mode == "hang":
    time.sleep(60)
if mode == "nan":
    print('{"reward": NaN}'); sys.exit(0)
print(json.dumps({"reward": float(row["extra_info"]["r"])}))
"""


def mixed_prompts(modes: list[str], rewards: list[float]) -> Prompts:
    records = [PromptRecord(prompt="q", label=m, extra_info={"r": r}) for m, r in zip(modes, rewards)]
    return Prompts(["q"] * len(modes), [TOK.encode("q", add_special_tokens=False)] * len(modes), records, 0, 0)


def test_failed_episodes_train_nothing_and_leave_their_group_s_mean_alone(tmp_path):
    source = episodes_for(tmp_path, FAILING, timeout=3.0)
    prompts = mixed_prompts(["ok", "ok", "crash", "ok", "ok", "hang"], [0.2, 0.6, 0, 0.4, 0.8, 0])
    started = time.monotonic()
    eps = source.episodes(tiny_engine(), prompts, list(range(6)), prompts.ids, seed=1)
    assert time.monotonic() - started < 30  # the hung program was killed at its bound
    assert eps.stats["failed"] == 2
    assert eps.rewards.tolist() == pytest.approx([0.2, 0.6, 0.5, 0.4, 0.8, 0.5])
    for k in (2, 5):
        assert sum(eps.action_masks[k]) == 0 and len(eps.responses[k]) == len(eps.action_masks[k]) >= 1
    assert all(sum(eps.action_masks[k]) > 0 for k in (0, 1, 3, 4))
    source.gateway.close()


@pytest.mark.parametrize("mode, words", [
    ("crash", "exited with status 3 (Traceback ... ValueError: the environment broke)"),
    ("nan", "has no finite number \"reward\""),
    ("no-call", "made no model call through OPENAI_BASE_URL"),
])
def test_most_episodes_failing_ends_the_run_with_the_first_reason(tmp_path, mode, words):
    source = episodes_for(tmp_path, FAILING)
    prompts = mixed_prompts(["ok", mode, mode], [0.5, 0, 0])
    with pytest.raises(AgentError) as err:
        source.episodes(tiny_engine(), prompts, [0, 1, 2], prompts.ids, seed=1)
    message = str(err.value)
    assert message.startswith("2 of 3 agent program episodes (--agent_command") and words in message, message
    assert "\n" not in message
    source.gateway.close()


def _rec(prompt: list[int], tokens: list[int]) -> Recorded:
    return Recorded(Call(prompt, 8), Completion(tokens, [-1.0] * len(tokens), "stop", 0))


def test_a_call_that_rewrites_history_is_left_out_of_the_row_and_counted():
    limits = EpisodeLimits(response_budget=9, prompt_max_len=16, timeout_s=1, max_concurrency=1)
    calls = [_rec([1, 2], [3, 4]), _rec([1, 2, 3, 5], [6]), _rec([1, 2, 3, 4, 7], [8, 9, 10, 11, 12])]
    row = branch_row(calls, limits)
    assert row.prompt == [1, 2] and row.off_branch == 1 and row.calls == 2
    assert row.response == [3, 4, 7, 8, 9, 10, 11, 12]
    assert row.mask == [1, 1, 0, 1, 1, 1, 1, 1] and not row.truncated
    cut = branch_row(calls, EpisodeLimits(response_budget=5, prompt_max_len=16, timeout_s=1, max_concurrency=1))
    assert cut.response == [3, 4, 7, 8, 9] and cut.truncated


@pytest.mark.parametrize("stdout, words", [
    ("", "printed nothing"), ("reward: 1", "is not JSON"), ('{"score": 1}', 'no finite number "reward"'),
    ('{"reward": true}', 'no finite number "reward"'),
])
def test_the_reward_line_is_checked(stdout, words):
    with pytest.raises(ValueError, match=words):
        parse_reward(stdout)
    assert parse_reward('log\n{"reward": 0.25}\n\n') == 0.25
    assert json.loads('{"reward": 1}')["reward"] == parse_reward('{"reward": 1}')


LENGTH_REWARD = """
import torch

def reward_func(queries, prompts, labels, **kwargs):
    return torch.tensor([float(len(q) - len(p)) for q, p in zip(queries, prompts)])
"""


def test_a_reward_function_scores_the_transcript_added_to_the_printed_reward_or_alone(tmp_path):
    """With --remote_rm_url FILE.py the reward file's score over the record's prompt + the session's decoded response
    (replies and the observation between them) is added to what the program prints, or is the reward of a program
    that prints none."""
    from rlrun.rewards.reward_fn import load_reward_function

    (tmp_path / "reward.py").write_text(LENGTH_REWARD)
    fn = load_reward_function(str(tmp_path / "reward.py"))
    engine, prompts = tiny_engine(), prompts_of(["7+5=", "9*9="])
    silent = SDK_AGENT.rsplit("print(json.dumps", 1)[0]  # its last line: the chatter
    for source, printed in ((SDK_AGENT, True), (silent, False)):
        (tmp_path / "run").mkdir(exist_ok=True)
        eps = episodes_for(tmp_path / "run", source, reward_fn=fn).episodes(engine, prompts, [0, 1], prompts.ids, 5)
        assert eps.stats["failed"] == 0
        for k in range(2):
            text = TOK.decode(eps.responses[k], skip_special_tokens=True)
            replies = TOK.decode([t for t, m in zip(eps.responses[k], eps.action_masks[k]) if m],
                                 skip_special_tokens=True)
            own = sum(c.isdigit() for c in replies) / max(1, len(replies)) + 2 if printed else 0.0
            assert eps.rewards[k].item() == pytest.approx(len(text) + own, abs=1e-5)
