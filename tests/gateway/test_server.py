"""The token gateway over real HTTP, with rlrun's native engine on a tiny Qwen2 and the byte tokenizer: the OpenAI SDK
as the client, concurrent requests batched into shared engine calls, answers that are exactly what the engine sampled
(ids, and log-probs equal to an HF forward of the row), and every refusal as one OpenAI-shaped error."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest
import torch

from helpers import SHARP_CAP as CAP
from helpers import SHARP_TEMPERATURE as TEMPERATURE
from helpers import hf_log_probs, sharp_native_engine
from rlrun.gateway.server import Gateway
from rlrun.gateway.wire import Limits, tool_calls
from rlrun.models.tiny import EOS_ID, build_byte_tokenizer

TOK = build_byte_tokenizer()


@pytest.fixture(scope="module")
def served():
    engine = sharp_native_engine()
    gateway = Gateway(Limits("tiny", TEMPERATURE, 1.0, CAP, 160), TOK, answer_timeout=20.0, max_calls=3)
    yield gateway, engine
    gateway.close()


def serve_while(gateway: Gateway, engine, clients: list) -> None:
    """Run each client on its own thread while this thread serves the gateway until they are all done."""
    threads = [threading.Thread(target=c) for c in clients]
    for t in threads:
        t.start()
    gateway.serve(engine, seed=11, version=4, until=lambda: not any(t.is_alive() for t in threads))
    for t in threads:
        t.join()


def test_openai_sdk_requests_are_batched_and_answered_with_the_engines_ids_and_log_probs(served):
    gateway, engine = served
    session = gateway.open_session()
    client = openai.OpenAI(base_url=session.base_url, api_key=gateway.token, max_retries=0, timeout=30)
    answers: dict[int, object] = {}

    def ask(i: int):
        def run():
            answers[i] = client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": f"count to {i}"}], logprobs=True,
                max_tokens=8 + i, extra_body={"return_token_ids": True})
        return run

    batches = gateway.batches
    serve_while(gateway, engine, [ask(i) for i in range(4)])
    assert gateway.batches - batches < 4  # concurrent requests shared engine calls
    assert len(session.calls) == 4
    for i, reply in answers.items():
        extra = reply.model_extra
        prompt, tokens = extra["prompt_token_ids"], reply.choices[0].model_extra["token_ids"]
        assert prompt == TOK.encode(f"User: count to {i}\nAssistant: ", add_special_tokens=False)
        assert 1 <= len(tokens) <= 8 + i
        assert reply.choices[0].finish_reason == ("stop" if tokens[-1] == EOS_ID else "length")
        assert reply.choices[0].message.content == TOK.decode(tokens, skip_special_tokens=True)
        content = reply.choices[0].logprobs.content
        assert [c.token for c in content] == [f"token_id:{t}" for t in tokens]
        lps = torch.tensor([c.logprob for c in content])
        torch.testing.assert_close(lps, hf_log_probs(engine.model, TEMPERATURE, prompt, tokens), rtol=0, atol=2e-4)
        recorded = next(r for r in session.calls if r.call.prompt == prompt)
        assert recorded.done.tokens == tokens and recorded.done.log_probs == [c.logprob for c in content]
        assert extra["weight_version"] == 4


def test_a_call_samples_the_same_whichever_calls_share_its_batch():
    """Draws are keyed by (session number, call number): three sessions asked at once, or one after another on a
    fresh gateway, get the same tokens (the runs through the gateway are repeatable)."""
    engine = sharp_native_engine()

    def tokens(together: bool) -> list[list[int]]:
        gateway = Gateway(Limits("tiny", TEMPERATURE, 1.0, CAP, 160), TOK, answer_timeout=20.0)
        sessions = [gateway.open_session() for _ in range(3)]
        got: dict[int, list[int]] = {}

        def ask(k: int):
            def run():
                body = {"model": "tiny", "messages": [{"role": "user", "content": "same"}], "return_token_ids": True}
                got[k] = _post(sessions[k].base_url + "/chat/completions", body, gateway.token)[1]["choices"][0][
                    "token_ids"]
            return run

        if together:
            serve_while(gateway, engine, [ask(k) for k in range(3)])
        else:
            for k in (2, 0, 1):
                serve_while(gateway, engine, [ask(k)])
        gateway.close()
        return [got[k] for k in range(3)]

    alone = tokens(False)
    assert tokens(True) == alone
    assert alone[0] != alone[1] != alone[2]  # the same prompt, different draws per session


def test_a_wave_of_64_connections_is_answered_in_one_or_two_engine_calls(served):
    """A step's episodes connect at once: none is reset (socketserver's default backlog is 5), and the gateway
    waits for the wave before it samples."""
    gateway, engine = served
    body = {"model": "tiny", "token_ids": [65, 66], "sampling_params": {"max_tokens": 3, "logprobs": 1}}
    statuses: list[int] = []
    batches = gateway.batches
    serve_while(gateway, engine, [lambda: statuses.append(
        _post(gateway.url + "/inference/v1/generate", body, gateway.token)[0]) for _ in range(64)])
    assert statuses == [200] * 64
    assert gateway.batches - batches <= 2


def _post(url: str, body: dict, key: str | None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_vllm_token_route_as_verifiers_calls_it_and_the_model_card(served):
    gateway, engine = served
    card = json.loads(urllib.request.urlopen(gateway.url + "/v1/models", timeout=10).read())
    assert card["data"][0]["id"] == "tiny" and card["data"][0]["max_model_len"] == 160
    out = {}
    body = {"model": "tiny", "token_ids": [70, 71, 72], "sampling_params": {
        "temperature": TEMPERATURE, "max_tokens": 6, "stop_token_ids": [EOS_ID], "logprobs": 1,
        "skip_special_tokens": False}}
    serve_while(gateway, engine, [lambda: out.update(r=_post(gateway.url + "/inference/v1/generate", body,
                                                                 gateway.token))])
    status, answer = out["r"]
    assert status == 200, answer
    choice = answer["choices"][0]
    assert answer["prompt_token_ids"] == [70, 71, 72] and 1 <= len(choice["token_ids"]) <= 6
    assert [c["token"] for c in choice["logprobs"]["content"]] == [f"token_id:{t}" for t in choice["token_ids"]]
    torch.testing.assert_close(torch.tensor([c["logprob"] for c in choice["logprobs"]["content"]]),
                               hf_log_probs(engine.model, TEMPERATURE, [70, 71, 72], choice["token_ids"]), rtol=0, atol=2e-4)


REFUSALS = {
    # what the request asks -> (status, words of the message)
    "temperature 0": ({"temperature": 0.0}, 400, "Unsupported value: 'temperature'"),
    "top_p": ({"top_p": 0.5}, 400, "'top_p'"),
    "over the cap": ({"max_tokens": CAP + 1}, 400, f"Only at most {CAP}, this run's cap"),
    "top_logprobs": ({"logprobs": True, "top_logprobs": 5}, 400, "top_logprobs"),
    "n 2": ({"n": 2}, 400, "'n'"),
    "stream": ({"stream": True}, 400, "'stream'"),
    "other model": ({"model": "gpt-4o"}, 404, "serves `tiny`"),
    "image": ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
              "only text content"),
    "too long": ({"messages": [{"role": "user", "content": "x" * 200}]}, 400, "maximum context length is 160"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_a_request_the_run_cannot_honour_is_refused_in_openais_shape(served, case):
    gateway, _ = served
    change, status, words = REFUSALS[case]
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]} | change
    got, answer = _post(gateway.url + "/v1/chat/completions", body, gateway.token)  # refused before the engine
    assert got == status and words in answer["error"]["message"], answer
    assert set(answer["error"]) == {"message", "type", "param", "code"}


def test_key_session_turn_limit_and_a_request_nobody_serves(served):
    gateway, engine = served
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    status, answer = _post(gateway.url + "/v1/chat/completions", body, "wrong")
    assert status == 401 and "bearer token" in answer["error"]["message"]
    status, answer = _post(gateway.url + "/s/feedbeef/v1/chat/completions", body, gateway.token)
    assert status == 404 and "no open session" in answer["error"]["message"]
    session = gateway.open_session()
    results = []
    serve_while(gateway, engine, [lambda: results.extend(
        _post(session.base_url + "/chat/completions", body, gateway.token) for _ in range(4))])
    assert [s for s, _ in results] == [200, 200, 200, 400]  # --max_turns 3
    assert "--max_turns" in results[3][1]["error"]["message"]
    gateway.close_session(session)
    # outside serve() (a weight sync, the update) a request waits, and gets 503 when its bound passes
    short = Gateway(Limits("tiny", TEMPERATURE, 1.0, CAP, 160), TOK, answer_timeout=0.5)
    try:
        started = time.monotonic()
        status, answer = _post(short.url + "/v1/chat/completions", body, short.token)
        assert status == 503 and "did not sample this request within 0.5 s" in answer["error"]["message"]
        assert time.monotonic() - started < 5
    finally:
        short.close()


def test_hermes_tool_calls_are_parsed_out_of_the_reply():
    text = 'Let me look.<tool_call>\n{"name": "search", "arguments": {"q": "rlrun"}}\n</tool_call>'
    head, calls = tool_calls(text)
    assert head == "Let me look." and calls[0]["function"]["name"] == "search"
    assert json.loads(calls[0]["function"]["arguments"]) == {"q": "rlrun"}
    assert tool_calls("<tool_call>{not json}</tool_call>") == ("<tool_call>{not json}</tool_call>", [])
    assert tool_calls("plain") == ("plain", [])
