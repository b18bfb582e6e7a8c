"""The gateway's wire formats: vLLM's token route and OpenAI's chat and completion requests read into one `Call`, and
the answers written with vLLM's token fields.

What a request may ask is what the run samples with: --temperature and --top_p are fixed for the run (a request that
names other values is refused with OpenAI's "Unsupported value" error, which clients such as OpenEnv's validate_llm
understand), n is 1, no streaming, no guided decoding, no penalties. max_tokens may lower the run's cap, never raise
it. Every sampled token is reported as vLLM's `--return-tokens-as-token-ids` spells it, "token_id:N", with the
engine's own log-probability (after temperature and top-p): the ids a trainer needs, never re-tokenised text.
"""

from __future__ import annotations

import json
import math
import re
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, cast

from transformers import PreTrainedTokenizerBase

from rlrun.data.sources import render
from rlrun.runtime.errors import DataError


class WireError(Exception):
    """A request the gateway refuses: its HTTP status and OpenAI's error fields."""

    def __init__(self, status: HTTPStatus, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param, self.code = status, param, code

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": str(self), "type": kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class Limits:
    """What the run lets a request ask for."""

    model: str  # the one model name served (GET /v1/models)
    temperature: float
    top_p: float
    max_tokens: int  # most new tokens one call may sample
    max_model_len: int  # prompt + new tokens


@dataclass(frozen=True)
class Call:
    """One request, read: the prompt ids and what ends its sampling."""

    prompt: list[int]
    max_tokens: int
    stop: tuple[str, ...] = ()  # strings that end the response (the token completing one kept)
    stop_token_ids: tuple[int, ...] = ()  # ids that end it besides the model's end ids (kept, as vLLM keeps them)
    logprobs: bool = False
    token_ids: bool = False  # answer with prompt_token_ids and each choice's token_ids
    tools: bool = False  # a chat request that offered tools: the reply's tool calls are parsed out


@dataclass(frozen=True)
class Completion:
    """What the engine sampled for one call: ids (the stop or end id kept), their log-probs, why it ended."""

    tokens: list[int]
    log_probs: list[float]
    finish_reason: str  # "stop" or "length"
    weight_version: int  # the weight sync the engine sampled with


# ---- reading requests --------------------------------------------------------------------------------------------

# Sampling parameters that would change what the engine samples, with the value that changes nothing.
NEUTRAL = {
    "top_k": (-1, 0, None),
    "min_p": (0, 0.0, None),
    "presence_penalty": (0, 0.0, None),
    "frequency_penalty": (0, 0.0, None),
    "repetition_penalty": (1, 1.0, None),
    "n": (1, None),
    "best_of": (1, None),
    "use_beam_search": (False, None),
    "stream": (False, None),
    "echo": (False, None),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "response_format": (None, {"type": "text"}),
    "logit_bias": (None, {}),
    "prompt_logprobs": (None, 0),
    "min_tokens": (0, None),
}


def _unsupported(name: str, value: Any, allowed: str) -> WireError:
    # OpenAI's wording: clients that adapt to refused parameters parse it.
    return WireError(
        HTTPStatus.BAD_REQUEST,
        f"Unsupported value: '{name}' does not support {value!r} with this model. Only {allowed} is supported "
        "(this rlrun run samples with fixed settings).",
        param=name,
        code="unsupported_value",
    )


def _check_fixed(params: Mapping[str, Any], limits: Limits) -> None:
    for name, fixed in (("temperature", limits.temperature), ("top_p", limits.top_p)):
        value = params.get(name)
        if value is None:
            continue
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isclose(value, fixed):
            raise _unsupported(name, value, f"the run's value ({fixed:g}, --{name})")
    for name, neutral in NEUTRAL.items():
        if name in params and params[name] not in neutral:
            raise _unsupported(name, params[name], f"{neutral[0]!r}")


def _int(params: Mapping[str, Any], name: str) -> int | None:
    value = params.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise WireError(HTTPStatus.BAD_REQUEST, f"'{name}' must be a positive integer, got {value!r}", param=name)
    return value


def _max_tokens(params: Mapping[str, Any], prompt_len: int, limits: Limits) -> int:
    name = "max_completion_tokens" if params.get("max_completion_tokens") is not None else "max_tokens"
    asked = _int(params, name)
    room = limits.max_model_len - prompt_len
    if room < 1:
        raise WireError(
            HTTPStatus.BAD_REQUEST,
            f"This model's maximum context length is {limits.max_model_len} tokens; the prompt has {prompt_len} "
            "(--prompt_max_len + --generate_max_len): shorten the conversation",
            param="messages",
            code="context_length_exceeded",
        )
    if asked is not None and asked > limits.max_tokens:
        # OpenAI's "Unsupported value" form: a client that adapts (OpenEnv's validate_llm) drops the field and gets
        # the run's cap
        raise _unsupported(
            name,
            asked,
            f"at most {limits.max_tokens}, this run's cap of new tokens per call (--generate_max_len, "
            "or --max_tokens_per_turn),",
        )
    return min(asked or limits.max_tokens, room)


def _strings(value: Any, name: str) -> tuple[str, ...]:
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items):
        raise WireError(HTTPStatus.BAD_REQUEST, f"'{name}' must be a string or a list of strings", param=name)
    return tuple(items)


def _ids(value: Any, name: str, vocab: int) -> list[int]:
    if (
        not isinstance(value, list)
        or not value
        or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in value)
    ):
        raise WireError(
            HTTPStatus.BAD_REQUEST, f"'{name}' must be a non-empty list of token ids below {vocab}", param=name
        )
    return value


def _object(payload: object) -> Mapping[str, Any]:
    if not isinstance(payload, dict):
        raise WireError(HTTPStatus.BAD_REQUEST, "the body must be a JSON object")
    return payload


def check_model(payload: Mapping[str, Any], limits: Limits) -> None:
    model = payload.get("model")
    if model is not None and model != limits.model:
        raise WireError(
            HTTPStatus.NOT_FOUND,
            f"The model `{model}` does not exist; this gateway serves `{limits.model}` (GET /v1/models)",
            param="model",
            code="model_not_found",
        )


def _logprobs_flag(params: Mapping[str, Any], top_name: str) -> bool:
    top = params.get(top_name)
    if top not in (None, 0):
        raise WireError(
            HTTPStatus.BAD_REQUEST,
            f"'{top_name}' {top!r} is not supported: the gateway reports the log-probability of each sampled token "
            f"only; leave {top_name} at 0",
            param=top_name,
        )
    return bool(params.get("logprobs"))


def read_generate(payload: object, limits: Limits, tokenizer: PreTrainedTokenizerBase) -> Call:
    """vLLM's token-in/token-out route (POST /inference/v1/generate), as verifiers' renderers client sends it:
    {"model", "token_ids", "sampling_params": {temperature, top_p, max_tokens, stop_token_ids, logprobs, ...}}."""
    body = _object(payload)
    check_model(body, limits)
    vocab = len(tokenizer)
    params = body.get("sampling_params") or {}
    if not isinstance(params, dict):
        raise WireError(HTTPStatus.BAD_REQUEST, "'sampling_params' must be an object", param="sampling_params")
    _check_fixed(params, limits)
    prompt = _ids(body.get("token_ids"), "token_ids", vocab)
    logprobs = params.get("logprobs")
    if logprobs not in (None, 0, 1) or isinstance(logprobs, bool):
        raise WireError(
            HTTPStatus.BAD_REQUEST,
            f"sampling_params.logprobs {logprobs!r} is not supported: the gateway reports the sampled token's "
            "log-probability only (logprobs 0 or 1)",
            param="logprobs",
        )
    return Call(
        prompt=prompt,
        max_tokens=_max_tokens(params, len(prompt), limits),
        stop=_strings(params.get("stop"), "stop"),
        stop_token_ids=tuple(_ids(params["stop_token_ids"], "stop_token_ids", vocab))
        if params.get("stop_token_ids")
        else (),
        logprobs=logprobs is not None,
        token_ids=True,
    )


def _text_content(content: Any, where: str) -> str | None:
    """A message's content as text: a string, None (an assistant turn of tool calls), or OpenAI's text parts."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise WireError(
        HTTPStatus.BAD_REQUEST, f"{where}: only text content is supported (a string or text parts)", param="messages"
    )


def _messages(value: Any) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise WireError(HTTPStatus.BAD_REQUEST, "'messages' must be a non-empty list", param="messages")
    out = []
    for k, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise WireError(HTTPStatus.BAD_REQUEST, f"messages[{k}] needs a string 'role'", param="messages")
        out.append({**m, "content": _text_content(m.get("content"), f"messages[{k}]")})
    return out


def read_chat(payload: object, limits: Limits, tokenizer: PreTrainedTokenizerBase) -> Call:
    """POST /v1/chat/completions: the messages (and any `tools`) through the model's chat template with the
    generation prompt, as vLLM renders them."""
    body = _object(payload)
    check_model(body, limits)
    _check_fixed(body, limits)
    if body.get("tool_choice") not in (None, "auto", "none"):
        raise _unsupported("tool_choice", body["tool_choice"], "'auto' or 'none'")
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise WireError(HTTPStatus.BAD_REQUEST, "'tools' must be a list", param="tools")
    kwargs = {"tools": tools} if tools else {}
    if isinstance(body.get("chat_template_kwargs"), dict):
        kwargs.update(body["chat_template_kwargs"])
    try:
        text = render(tokenizer, _messages(body.get("messages")), True, "the request's messages", kwargs)
    except DataError as exc:
        raise WireError(HTTPStatus.BAD_REQUEST, str(exc), param="messages") from None
    prompt = tokenizer.encode(text, add_special_tokens=False)
    return Call(
        prompt=prompt,
        max_tokens=_max_tokens(body, len(prompt), limits),
        stop=_strings(body.get("stop"), "stop"),
        stop_token_ids=tuple(_ids(body["stop_token_ids"], "stop_token_ids", len(tokenizer)))
        if body.get("stop_token_ids")
        else (),
        logprobs=_logprobs_flag(body, "top_logprobs"),
        token_ids=bool(body.get("return_token_ids")),
        tools=bool(tools),
    )


def read_completion(payload: object, limits: Limits, tokenizer: PreTrainedTokenizerBase) -> Call:
    """POST /v1/completions: `prompt` as text (tokenised as vLLM does, with the tokenizer's special tokens) or as a
    list of token ids; one prompt per request."""
    body = _object(payload)
    check_model(body, limits)
    _check_fixed(body, limits)
    raw = body.get("prompt")
    if isinstance(raw, str):
        prompt = tokenizer.encode(raw)
    elif isinstance(raw, list) and raw and all(isinstance(t, int) for t in raw):
        prompt = _ids(raw, "prompt", len(tokenizer))
    else:
        raise WireError(HTTPStatus.BAD_REQUEST, "'prompt' must be one string or one list of token ids", param="prompt")
    logprobs = body.get("logprobs")
    if logprobs not in (None, 0, 1) or isinstance(logprobs, bool):
        raise WireError(
            HTTPStatus.BAD_REQUEST,
            f"'logprobs' {logprobs!r} is not supported: the sampled token's log-probability only (0 or 1)",
            param="logprobs",
        )
    return Call(
        prompt=prompt,
        max_tokens=_max_tokens(body, len(prompt), limits),
        stop=_strings(body.get("stop"), "stop"),
        logprobs=logprobs is not None,
        token_ids=bool(body.get("return_token_ids")),
    )


# ---- writing answers ---------------------------------------------------------------------------------------------


def _token_logprobs(done: Completion) -> list[dict]:
    return [
        {"token": f"token_id:{t}", "logprob": lp, "bytes": None, "top_logprobs": []}
        for t, lp in zip(done.tokens, done.log_probs)
    ]


def _usage(call: Call, done: Completion) -> dict:
    n, m = len(call.prompt), len(done.tokens)
    return {"prompt_tokens": n, "completion_tokens": m, "total_tokens": n + m}


def _envelope(kind: str, prefix: str, choice: dict, call: Call, done: Completion, limits: Limits) -> dict:
    """OpenAI's answer around its one choice, with vLLM's token fields when the request asked for them."""
    out = {
        "id": f"{prefix}-{uuid.uuid4().hex}",
        "object": kind,
        "created": int(time.time()),
        "model": limits.model,
        "choices": [choice],
        "usage": _usage(call, done),
        "weight_version": done.weight_version,
    }
    if call.token_ids:
        choice["token_ids"] = done.tokens
        out["prompt_token_ids"] = call.prompt
    return out


def answer_generate(call: Call, done: Completion, limits: Limits, tokenizer: PreTrainedTokenizerBase) -> dict:
    choice = {
        "index": 0,
        "token_ids": done.tokens,
        "logprobs": {"content": _token_logprobs(done)} if call.logprobs else None,
        "finish_reason": done.finish_reason,
    }
    return {
        "request_id": f"gen-{uuid.uuid4().hex}",
        "prompt_token_ids": call.prompt,
        "choices": [choice],
        "usage": _usage(call, done),
        "weight_version": done.weight_version,
    }


# Hermes-style tool calls (Qwen2.5/3, SmolLM3, ...): <tool_call>{"name": ..., "arguments": {...}}</tool_call>
TOOL_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)


def tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """The reply's text before its first tool call, and its Hermes-style tool calls in OpenAI's shape (what vLLM's
    hermes parser returns); (text, []) when it calls none or a call is not valid JSON with a name."""
    found = []
    for match in TOOL_CALL.finditer(text):
        try:
            call = json.loads(match.group(1))
        except ValueError:
            return text, []
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return text, []
        arguments = call.get("arguments", {})
        found.append(
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": call["name"], "arguments": json.dumps(arguments)},
            }
        )
    if not found:
        return text, []
    head = text[: text.index("<tool_call>")].strip()
    return head or None, found


def answer_chat(call: Call, done: Completion, limits: Limits, tokenizer: PreTrainedTokenizerBase) -> dict:
    text = cast(str, tokenizer.decode(done.tokens, skip_special_tokens=True))  # one row of ids: one text
    content, calls = tool_calls(text) if call.tools else (text, [])
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
    choice: dict[str, Any] = {
        "index": 0,
        "message": message,
        "logprobs": {"content": _token_logprobs(done)} if call.logprobs else None,
        "finish_reason": "tool_calls" if calls and done.finish_reason == "stop" else done.finish_reason,
    }
    return _envelope("chat.completion", "chatcmpl", choice, call, done, limits)


def answer_completion(call: Call, done: Completion, limits: Limits, tokenizer: PreTrainedTokenizerBase) -> dict:
    choice: dict[str, Any] = {
        "index": 0,
        "text": tokenizer.decode(done.tokens, skip_special_tokens=True),
        "logprobs": {
            "tokens": [f"token_id:{t}" for t in done.tokens],
            "token_logprobs": done.log_probs,
            "top_logprobs": None,
            "text_offset": None,
        }
        if call.logprobs
        else None,
        "finish_reason": done.finish_reason,
    }
    return _envelope("text_completion", "cmpl", choice, call, done, limits)


def models(limits: Limits) -> dict:
    """GET /v1/models: the one served model and its context length (verifiers reads max_model_len)."""
    card = {
        "id": limits.model,
        "object": "model",
        "created": 0,
        "owned_by": "rlrun",
        "root": limits.model,
        "max_model_len": limits.max_model_len,
    }
    return {"object": "list", "data": [card]}


@dataclass(frozen=True)
class Route:
    """A POST route: how its request is read and its answer written."""

    read: Callable[[object, Limits, PreTrainedTokenizerBase], Call]
    answer: Callable[[Call, Completion, Limits, PreTrainedTokenizerBase], dict]


ROUTES = {
    "/v1/chat/completions": Route(read_chat, answer_chat),
    "/v1/completions": Route(read_completion, answer_completion),
    "/inference/v1/generate": Route(read_generate, answer_generate),
}
