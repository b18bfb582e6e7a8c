"""A reward server for `--remote_rm_url http://HOST:PORT/reward` (OpenRLHF's request format).

    python -m rlrun.reward_server --reward_file my_reward.py --host 0.0.0.0 --port 5000

POST /reward   {"query": [...], "prompts": [...], "labels": [...]}
               -> 200 {"rewards": [...], "scores": [...], "extra_logs": {...}}
GET  /health   -> 200 {"status": "ok"}

The reward file defines `reward_func(queries, prompts, labels)` (the same file works locally as
`--remote_rm_url my_reward.py`); its output is validated exactly as in training. Standard library
only, JSON only (never pickle). Set RLRUN_REWARD_TOKEN to require `Authorization: Bearer <token>`
on /reward (training sends it from the same variable). Errors are JSON `{"error": "..."}`:
400 bad request, 401 missing/wrong token, 404/405 wrong path or method, 411 no Content-Length,
413 body over --max_request_bytes, 500 the reward function failed or returned bad values.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import threading
from collections.abc import Sequence
from http import HTTPStatus
from typing import Any

from rlrun.rewards.reward_fn import TOKEN_ENV, RewardFunction, load_reward_function
from rlrun.runtime.errors import RewardError
from rlrun.serving.http_service import (
    BadRequest,
    JsonHandler,
    JsonHTTPServer,
    add_server_arguments,
    serve,
    server_arguments_error,
)


def parse_batch(payload: object) -> tuple[list[str], list[str], list[Any]]:
    """Validate an OpenRLHF reward request; missing prompts default to "" and labels to None. A label is any JSON
    value (a string, a number, a list of answers, {"target": [...]}): the reward file receives it as it is."""
    if not isinstance(payload, dict):
        raise BadRequest(HTTPStatus.BAD_REQUEST, f"request body must be a JSON object, got {type(payload).__name__}")
    unknown = sorted(set(payload) - {"query", "queries", "prompts", "labels"})
    if unknown:
        raise BadRequest(HTTPStatus.BAD_REQUEST, f"unknown key(s) {unknown}; expected 'query', 'prompts', 'labels'")
    queries = payload.get("query", payload.get("queries"))
    if not isinstance(queries, list) or not all(isinstance(q, str) for q in queries):
        raise BadRequest(HTTPStatus.BAD_REQUEST, "'query' must be a list of strings (prompt + response text)")
    n = len(queries)
    prompts = payload.get("prompts")
    if prompts is None:
        prompts = [""] * n
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise BadRequest(HTTPStatus.BAD_REQUEST, "'prompts' must be a list of strings")
    labels = payload.get("labels")
    if labels is None:
        labels = [None] * n
    if not isinstance(labels, list):
        raise BadRequest(HTTPStatus.BAD_REQUEST, "'labels' must be a list (one JSON value or null per query)")
    if not len(prompts) == len(labels) == n:
        raise BadRequest(
            HTTPStatus.BAD_REQUEST,
            f"got {n} queries, {len(prompts)} prompts and {len(labels)} labels; "
            "send one prompt and one label (or null) per query",
        )
    return queries, prompts, labels


class RewardHTTPServer(JsonHTTPServer):
    def __init__(
        self,
        address: tuple[str, int],
        reward: RewardFunction,
        *,
        token: str | None,
        max_request_bytes: int,
        request_timeout: float,
        concurrency: int,
        quiet: bool,
    ) -> None:
        self.reward = reward
        # Reward functions are often not thread-safe; by default one batch is scored at a time.
        self.slots = threading.BoundedSemaphore(concurrency)
        super().__init__(
            address,
            RewardHandler,
            log_name="reward-server",
            token=token,
            token_env=TOKEN_ENV,
            max_request_bytes=max_request_bytes,
            request_timeout=request_timeout,
            quiet=quiet,
        )


class RewardHandler(JsonHandler):
    server: RewardHTTPServer
    server_version = "rlrun-reward-server"
    post_paths = ("/reward", "/get_reward")  # the second is the alias OpenRLHF's example server uses

    def handle_post(self, path: str, payload: object) -> tuple[dict, int | None]:
        queries, prompts, labels = parse_batch(payload)
        with self.server.slots:
            result = self.server.reward(queries, prompts, labels)  # a RewardError is answered as a 500
        return {
            "rewards": result.rewards.tolist(),
            "scores": result.scores.tolist(),
            "extra_logs": {k: v for k, v in result.extra_logs.items() if math.isfinite(v)},
        }, len(queries)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m rlrun.reward_server",
        description="Serve reward_func(queries, prompts, labels) from a Python file over HTTP for "
        "--remote_rm_url http://HOST:PORT/reward (OpenRLHF's request and response format).",
    )
    parser.add_argument(
        "--reward_file", required=True, help="Python file defining reward_func(queries, prompts, labels)."
    )
    add_server_arguments(parser, default_port=5000)
    parser.add_argument(
        "--concurrency",
        type=int,
        default=1,
        help="Batches scored at the same time (default 1: reward functions need not be thread-safe).",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    problem = server_arguments_error(args) or ("need --concurrency >= 1" if args.concurrency < 1 else None)
    if problem:
        print(f"rlrun reward server: error: {problem}", file=sys.stderr)
        return 2
    if not args.reward_file.strip().endswith(".py"):
        print("rlrun reward server: error: --reward_file must be a .py file defining reward_func", file=sys.stderr)
        return 2
    try:
        reward = load_reward_function(args.reward_file)
    except RewardError as exc:
        print(f"rlrun reward server: error: {exc}", file=sys.stderr)
        return 2
    token = os.environ.get(TOKEN_ENV) or None
    return serve(
        "rlrun reward server",
        lambda: RewardHTTPServer(
            (args.host, args.port),
            reward,
            token=token,
            max_request_bytes=args.max_request_bytes,
            request_timeout=args.request_timeout,
            concurrency=args.concurrency,
            quiet=args.quiet,
        ),
        host=args.host,
        port=args.port,
        details=f"POST /reward, GET /health; reward file {args.reward_file}",
        exposes="call the reward function",
    )
