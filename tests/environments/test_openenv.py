"""OpenEnv servers (--openenv_url): a real OpenEnv 0.10 server (tests/environments/openenv_chars_server.py, create_app
served by uvicorn in the OpenEnv lane) and rlrun's own WebSocket client, the gateway and the native engine. The row
is the episode's ids: the prompt with the reset observation, the replies (actions, the engine's log-probs), the
observation between them in the chat template's turn markers (mask 0); the reward is the sum of the step rewards."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from helpers import REPO, SHARP_TEMPERATURE, hf_log_probs, refusing_port, sharp_native_engine
from openenv_lane import OPENENV_PYTHON, lane_env, needs_openenv, openenv_server
from rlrun.cli.parser import parse_args
from rlrun.data.prompts import PromptRecord, Prompts
from rlrun.environments.openenv import build_openenv_episodes
from rlrun.environments.openenv import start_app
from rlrun.models.tiny import EOS_ID, build_byte_tokenizer
from rlrun.runtime.errors import AgentError, ConfigError

TOK = build_byte_tokenizer()
HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def server():
    with openenv_server("openenv_chars_server:app", HERE) as url:
        yield url


def _source(url: str, *extra: str):
    cfg = parse_args(["--openenv_url", url, "--generate_max_len", "64", "--max_tokens_per_turn", "8",
                      "--temperature", str(SHARP_TEMPERATURE), *extra]).config
    return build_openenv_episodes(cfg.agent, cfg.generation, TOK, "tiny", 0)


def _prompts(labels: list[str]) -> Prompts:
    records = [PromptRecord(prompt="Play.", label=label) for label in labels]
    ids = [TOK.encode("Play.", add_special_tokens=False)] * len(labels)
    return Prompts([f"Play {label}" for label in labels], ids, records, 0, 0)


@needs_openenv
def test_two_steps_become_one_row_with_the_observation_between_them(server):
    source, engine = _source(server), sharp_native_engine()
    prompts = _prompts(["digits", "letters", "digits"])
    eps = source.episodes(engine, prompts, [0, 1, 2], prompts.ids, seed=4)
    assert eps.stats["failed"] == 0 and eps.stats["steps"] == 6 and eps.stats["turns"] == 6
    for k, label in enumerate(["digits", "letters", "digits"]):
        assert TOK.decode(eps.prompts[k]) == f"User: Play.\n\nReply with {label} only.\nAssistant: "
        mask, response = eps.action_masks[k], eps.responses[k]
        first = mask.index(0)
        gap = mask[first:].index(1)
        assert mask == [1] * first + [0] * gap + [1] * (len(mask) - first - gap)
        ended = response[first - 1] == EOS_ID  # the template's end marker comes from the reply when it was sampled
        bridge = ("" if ended else "<|eos|>") + "\nUser: Once more.\nAssistant: "
        assert TOK.decode(response[first:first + gap]) == bridge
        replies = [TOK.decode(response[:first], skip_special_tokens=True),
                   TOK.decode(response[first + gap:], skip_special_tokens=True)]
        targets = "0123456789" if label == "digits" else "abcdefghijklmnopqrstuvwxyz"
        shares = [sum(c in targets for c in r) / max(1, len(r)) for r in replies]
        assert eps.rewards[k].item() == pytest.approx(sum(shares), abs=1e-6)
        full = hf_log_probs(engine.model, SHARP_TEMPERATURE, eps.prompts[k], response)
        sampled = torch.tensor(mask, dtype=torch.bool)
        torch.testing.assert_close(torch.tensor(eps.log_probs[k])[sampled], full[sampled], rtol=0, atol=2e-4)
    last = _source(server, "--openenv_reward", "last").episodes(engine, prompts, [0], prompts.ids[:1], seed=4)
    assert last.rewards[0].item() <= eps.rewards[0].item()


@needs_openenv
def test_a_server_error_fails_its_episode_and_most_failing_is_one_line(server):
    source, engine = _source(server), sharp_native_engine()
    prompts = _prompts(["digits", "broken", "letters", "digits"])
    eps = source.episodes(engine, prompts, [0, 1, 2, 3], prompts.ids, seed=4)
    assert eps.stats["failed"] == 1 and sum(eps.action_masks[1]) == 0
    with pytest.raises(AgentError, match="the server answered reset with error: no such game"):
        source.episodes(engine, prompts, [1, 1, 0], prompts.ids[:3], seed=4)


def test_a_server_that_is_not_there_is_one_clear_error_before_any_episode():
    with pytest.raises(ConfigError, match=r"--openenv_url http://127.0.0.1:\d+: GET http://127.0.0.1:\d+/schema failed"):
        _source(f"http://127.0.0.1:{refusing_port()}")


@needs_openenv
def test_an_app_that_does_not_start_is_one_clear_error_with_its_output():
    with pytest.raises(ConfigError, match=r"--openenv_app no_such_env_module:app .* exited with status 3 "
                       '.*Could not import module "no_such_env_module"'):
        start_app("no_such_env_module:app", str(OPENENV_PYTHON), str(HERE), lane_env())


@needs_openenv
def test_a_started_server_dies_with_the_rank_that_started_it(tmp_path):
    """A rank killed outright (SIGKILL: no atexit) takes its --openenv_app server with it (PR_SET_PDEATHSIG)."""
    code = ("import sys, time; from rlrun.environments.openenv import start_app; "
            f"s = start_app('openenv_chars_server:app', {str(OPENENV_PYTHON)!r}, {str(HERE)!r}); "
            "print(s.url, s.process.pid, flush=True); time.sleep(120)")
    rank = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=str(REPO / "src")))
    url, pid = rank.stdout.readline().split()
    assert urllib.request.urlopen(url + "/health", timeout=5).status == 200
    rank.kill()
    rank.wait(timeout=10)
    deadline = time.monotonic() + 15
    while _alive(int(pid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(int(pid))


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize(("properties", "required", "field"), [
    ({"metadata": {"type": "object"}, "message": {"type": "string"}}, ["message"], "message"),
    ({"guess": {"type": "string"}, "confidence": {"type": "number", "default": 0.5}}, ["guess"], "guess"),
    ({"command": {"type": "string"}}, [], "command"),
    ({"command": {"type": "string"}, "steps": {"type": "integer"}}, ["command", "steps"], None),
    ({"x": {"type": "integer"}, "y": {"type": "integer"}}, ["x", "y"], None),
    ({"a": {"type": "string"}, "b": {"type": "string"}}, ["a", "b"], None),
])
def test_the_reply_fills_the_action_s_one_text_field_or_is_read_as_json(properties, required, field):
    """OpenEnv actions as pydantic writes their schema (metadata has a default): the reply text goes into the one text
    field a reply can fill alone; any other action is the reply's JSON object."""
    from rlrun.environments.openenv import EpisodeFailed, action_of, text_field

    assert text_field({"properties": properties, "required": required}) == field
    if field is None:
        assert action_of('I move {"x": 1, "y": 2} now', None) == {"x": 1, "y": 2}
        with pytest.raises(EpisodeFailed, match="is not a JSON object of the server's action"):
            action_of("left", None)


@needs_openenv
def test_a_server_that_holds_one_session_at_a_time_serves_every_episode_in_turn():
    """create_app's default (max_concurrent_envs 1): the other episodes' resets are refused with CAPACITY_REACHED;
    each waits (backing off) and takes the session when it is free, so every episode runs and none fails."""
    with openenv_server("openenv_chars_server:single", HERE) as url:
        source, engine = _source(url), sharp_native_engine()
        prompts = _prompts(["digits", "letters", "digits", "letters"])
        eps = source.episodes(engine, prompts, [0, 1, 2, 3], prompts.ids, seed=4)
    assert eps.stats["failed"] == 0 and eps.stats["steps"] == 8
    assert eps.stats["server_full_waits"] > 0
