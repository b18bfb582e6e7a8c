"""Start `python -m rlrun.retriever_server` as a real process on a free 127.0.0.1 port, and stop it."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from helpers import REPO, stop_process, subprocess_env

EXAMPLE_CORPUS = REPO / "examples" / "search_r1" / "corpus.jsonl"
EXAMPLE_TRAIN = REPO / "examples" / "search_r1" / "train.jsonl"


@dataclass
class RetrieverProcess:
    proc: subprocess.Popen
    port: int
    stdout_path: Path
    stderr_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/retrieve"

    def log(self) -> str:
        """The per-request log lines so far (stderr)."""
        return self.stderr_path.read_text()

    def wait_log_lines(self, fragment: str, count: int, timeout: float = 10.0) -> int:
        """Lines containing fragment, once there are at least `count` (the server writes the line just
        after answering, so a client may see the answer first)."""
        deadline = time.monotonic() + timeout
        while True:
            found = sum(fragment in line for line in self.log().splitlines())
            if found >= count or time.monotonic() > deadline:
                return found
            time.sleep(0.02)


def start_retriever(tmp_path: Path, corpus: Path = EXAMPLE_CORPUS, extra_args: list[str] | None = None,
                    env_extra: dict[str, str] | None = None, timeout: float = 60.0) -> RetrieverProcess:
    out_path, err_path = tmp_path / "retriever.out", tmp_path / "retriever.err"
    env = subprocess_env(**(env_extra or {}))
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", "rlrun.retriever_server", "--corpus_path", str(corpus),
                                 "--host", "127.0.0.1", "--port", "0", *(extra_args or [])],
                                stdout=out, stderr=err, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout
        marker = "listening on http://127.0.0.1:"
        while marker not in out_path.read_text():
            if proc.poll() is not None:
                raise AssertionError(f"retriever exited {proc.returncode}: {err_path.read_text()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"retriever did not start in {timeout} s: {err_path.read_text()}")
            time.sleep(0.05)
        port = int(out_path.read_text().split(marker, 1)[1].split()[0])
        server = RetrieverProcess(proc, port, out_path, err_path)
        while True:  # /health answers once serve_forever runs
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
                    if json.loads(response.read())["status"] == "ok":
                        return server
            except OSError:
                if time.monotonic() > deadline:
                    raise
            time.sleep(0.05)
    except BaseException:
        stop_process(proc)
        raise


stop_retriever = stop_process
