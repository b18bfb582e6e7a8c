"""rlrun.reward_server as a real process on 127.0.0.1, driven by raw HTTP and by rlrun's own client."""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import start_reward_server, stop_process

from rlrun.rewards.reward_fn import TOKEN_ENV, load_reward_function
from rlrun.runtime.errors import RewardError

TOKEN = "s3cr3t-token-value"

REWARD_FILE = '''
def reward_func(queries, prompts, labels):
    if "boom" in labels:
        raise ValueError("exploded\\nsecond line of the message")
    if "nan" in labels:
        return [float("nan")] * len(queries)
    if "short" in labels:
        return [1.0]
    return {
        "rewards": [float(len(q)) for q in queries],
        "scores": [float(len(p)) for p in prompts],
        "extra_logs": {"is_labelled": [0.0 if label is None else 1.0 for label in labels]},
    }
'''


class Server:
    def __init__(self, proc: subprocess.Popen, port: int, stderr_path: Path) -> None:
        self.proc, self.port, self.stderr_path = proc, port, stderr_path
        self.url = f"http://127.0.0.1:{port}/reward"

    def request(self, method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None,
                token: str | None = TOKEN) -> tuple[int, dict]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            all_headers = {"Content-Type": "application/json", **(headers or {})}
            if token is not None:
                all_headers["Authorization"] = f"Bearer {token}"
            conn.request(method, path, body=body, headers=all_headers)
            response = conn.getresponse()
            return response.status, json.loads(response.read() or b"{}")
        finally:
            conn.close()

    def post(self, payload: object, **kwargs) -> tuple[int, dict]:
        return self.request("POST", "/reward", json.dumps(payload).encode(), **kwargs)


def start_server(tmp_path: Path, extra_args: list[str], env_extra: dict[str, str], timeout: float = 60) -> Server:
    reward_file = tmp_path / "reward.py"
    reward_file.write_text(REWARD_FILE)
    proc, port = start_reward_server(reward_file, tmp_path, extra_args, env_extra, timeout)
    return Server(proc, port, tmp_path / "server.err")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    srv = start_server(tmp_path_factory.mktemp("reward_server"),
                       ["--max_request_bytes", "4096", "--request_timeout", "1"], {TOKEN_ENV: TOKEN})
    try:
        yield srv
    finally:
        stop_process(srv.proc)


def test_health_needs_no_token(server: Server) -> None:
    assert server.request("GET", "/health", token=None) == (200, {"status": "ok"})


def test_reward_roundtrip_raw_http(server: Server) -> None:
    status, body = server.post({"query": ["ab", "abcd"], "prompts": ["a", "abc"], "labels": ["x", None]})
    # Any JSON label reaches the reward file as it is (Search-R1's {"target": [...]}, a number).
    assert server.post({"query": ["ab", "c"], "labels": [{"target": ["ab"]}, 3]})[0] == 200
    assert status == 200
    assert body == {"rewards": [2.0, 4.0], "scores": [1.0, 3.0], "extra_logs": {"is_labelled": 0.5}}
    # OpenRLHF senders that omit prompts/labels still get an answer.
    assert server.post({"query": ["abc"]}) == (200, {"rewards": [3.0], "scores": [0.0], "extra_logs": {"is_labelled": 0.0}})
    # The alias OpenRLHF's example server uses.
    status, _ = server.request("POST", "/get_reward", json.dumps({"query": ["a"]}).encode())
    assert status == 200


def test_client_roundtrip_matches_local_file(server: Server, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    queries, prompts, labels = ["hello world", "x"], ["hello", ""], ["a", None]
    remote = load_reward_function(server.url, retries=1)(queries, prompts, labels)
    local_file = tmp_path / "local_reward.py"
    local_file.write_text(REWARD_FILE)
    local = load_reward_function(str(local_file))(queries, prompts, labels)
    assert remote.rewards.tolist() == local.rewards.tolist() == [11.0, 1.0]
    assert remote.scores.tolist() == local.scores.tolist()
    assert remote.extra_logs == local.extra_logs == {"is_labelled": 0.5}


def test_missing_or_wrong_token_is_401_and_never_logged(server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    payload = {"query": ["a"]}
    for token in (None, "wrong", TOKEN + "x", "ünïcode"):
        status, body = server.post(payload, token=token)
        assert status == 401, token
        assert "bearer token" in body["error"]
    status, _ = server.post(payload, token=None, headers={"Authorization": f"Basic {TOKEN}"})
    assert status == 401
    monkeypatch.setenv(TOKEN_ENV, "not-the-token")
    with pytest.raises(RewardError, match="401"):
        load_reward_function(server.url, retries=1)(["a"], [""], [None])
    assert TOKEN not in server.stderr_path.read_text()


@pytest.mark.parametrize("body, fragment", [
    (b"{not json", "not valid UTF-8 JSON"),
    (b"\xff\xfe", "not valid UTF-8 JSON"),
    (b'{"query": [NaN]}', "not valid UTF-8 JSON"),
    (b"[1, 2]", "must be a JSON object"),
    (b'{"query": "one string"}', "'query' must be a list of strings"),
    (b'{"query": [1]}', "'query' must be a list of strings"),
    (b'{"query": ["a"], "prompts": ["a", "b"]}', "1 queries, 2 prompts"),
    (b'{"query": ["a"], "labels": "x"}', "'labels' must be a list"),
    (b'{"query": ["a"], "extra": 1}', "unknown key"),
])
def test_bad_requests_are_400_with_a_message(server: Server, body: bytes, fragment: str) -> None:
    status, answer = server.request("POST", "/reward", body)
    assert status == 400
    assert fragment in answer["error"]


def test_reward_function_errors_are_500_one_line(server: Server) -> None:
    status, body = server.post({"query": ["a"], "labels": ["boom"]})
    assert status == 500
    assert "ValueError: exploded second line of the message" in body["error"]
    assert "\n" not in body["error"]
    for label, fragment in (("nan", "NaN/inf"), ("short", "1 values for 2 queries")):
        status, body = server.post({"query": ["a", "b"], "labels": [label, label]})
        assert status == 500 and fragment in body["error"], body


def test_client_reports_server_500(server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    with pytest.raises(RewardError, match="HTTP 500.*exploded"):
        load_reward_function(server.url, retries=1)(["a"], [""], ["boom"])


def test_oversized_body_is_413_without_reading_it(server: Server) -> None:
    status, body = server.post({"query": ["x" * 5000]})
    assert status == 413 and "over the limit of 4096 bytes" in body["error"]
    # A huge announced length is refused at once, not waited for.
    started = time.monotonic()
    status, body = server.request("POST", "/reward", None, headers={"Content-Length": str(10**12)})
    assert status == 413 and time.monotonic() - started < 5


def test_wrong_path_and_method(server: Server) -> None:
    assert server.request("GET", "/nope")[0] == 404
    assert server.request("POST", "/nope", b"{}")[0] == 404
    assert server.request("GET", "/reward")[0] == 405


def test_missing_length_is_411(server: Server) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(f"POST /reward HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n\r\n".encode())
        answer = sock.recv(4096).decode()
    assert answer.startswith("HTTP/1.1 411")


def test_stalled_client_is_cut_off_by_request_timeout(server: Server) -> None:
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", server.port), timeout=20) as sock:
        sock.sendall(f"POST /reward HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
                     "Content-Length: 100\r\n\r\n{\"query\"".encode())
        assert sock.recv(4096) == b""  # the server closes the connection instead of waiting forever
    assert time.monotonic() - started < 10
    assert server.request("GET", "/health") == (200, {"status": "ok"})  # and keeps serving


def test_keep_alive_serves_several_requests_on_one_connection(server: Server) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        for n in range(3):
            conn.request("POST", "/reward", body=json.dumps({"query": ["a" * n]}),
                         headers={"Authorization": f"Bearer {TOKEN}"})
            response = conn.getresponse()
            assert response.status == 200 and json.loads(response.read())["rewards"] == [float(n)]
    finally:
        conn.close()


def test_no_token_server_and_clean_sigterm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    srv = start_server(tmp_path, ["--quiet"], {TOKEN_ENV: ""})
    try:
        monkeypatch.delenv(TOKEN_ENV, raising=False)
        result = load_reward_function(srv.url, retries=1)(["abc"], ["a"], ["l"])
        assert result.rewards.tolist() == [3.0]
    finally:
        assert stop_process(srv.proc) == 0
    assert "stopped" in (tmp_path / "server.out").read_text()


def test_bad_reward_file_exits_2_with_the_reason(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("def not_reward_func(): pass\n")
    for path in (str(bad), "http://example.invalid/reward"):
        proc = subprocess.run([sys.executable, "-m", "rlrun.reward_server", "--reward_file", path, "--port", "0"],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2, proc.stderr
        assert "rlrun reward server: error:" in proc.stderr
