"""rlrun's verifiers harness, id `rlrun-chat` (--env_harness's default): a chat loop through the episode's own
endpoint, in process (verifiers' shipped harnesses start programs with uv, which needs the network); verifiers records
each call's tokens itself. A top-level package of rlrun's distribution because verifiers resolves a harness id to a
top-level module (`rlrun-chat` -> `rlrun_chat`), never to a dotted one.

The loop: the task's prompt (with its system prompt) as a chat request offering the taskset's MCP tools (each tool
server's tools as `<server>_<tool>`, listed and called with verifiers' own MCP client); each reply's tool calls run
on their servers and their results go back as tool messages; it ends at a reply without tool calls, or when
verifiers refuses a call (--max_turns: its interception server's own cap). Each reply is sent back exactly as it came,
so the calls extend one branch of the trace. A multi-turn environment's later segments (a user's turn) relaunch the
loop on the whole conversation (verifiers' default resume)."""

from __future__ import annotations

import json
from contextlib import AsyncExitStack
from typing import Any

import httpx
import verifiers.v1 as vf
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.harnesses.utils.mcp import call_mcp, connect_mcp
from verifiers.v1.runtimes import ProgramResult


class RlrunChatConfig(vf.HarnessConfig):
    pass


class RlrunChat(vf.Harness[RlrunChatConfig]):
    NEEDS_CONTAINER = False
    EXECUTES_CODE = False
    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_MCP = True
    SUPPORTS_RESUME = True  # stateless: a later segment replays the conversation

    async def launch(
        self, ctx: Any, trace: Any, runtime: Any, endpoint: str, secret: str, mcp_urls: Any, data: Any, **kwargs: Any
    ) -> Any:
        system, prompt = self.resolve_prompt(data)
        if isinstance(prompt, str):
            messages: list[Any] = [{"role": "user", "content": prompt}]
        else:
            messages = [m if isinstance(m, dict) else message_to_wire(m) for m in prompt or []]
        if system:
            messages = [{"role": "system", "content": system}, *messages]
        async with AsyncExitStack() as stack:
            servers_config = {"mcpServers": {name: {"url": url} for name, url in (mcp_urls or {}).items()}}
            tools, dispatch, servers = await connect_mcp(servers_config, stack) if mcp_urls else ([], {}, {})
            # the episode's own timeout bounds every wait (verifiers')
            client = await stack.enter_async_context(httpx.AsyncClient(timeout=None))
            while True:
                body: dict[str, Any] = {"model": ctx.model, "messages": messages}
                if tools:
                    body["tools"] = tools
                reply = await client.post(
                    f"{endpoint}/chat/completions", headers={"Authorization": f"Bearer {secret}"}, json=body
                )
                if reply.status_code != 200:  # verifiers' refusal at its turn cap ends the loop as it expects
                    return ProgramResult(exit_code=1, stdout="", stderr=f"HTTP {reply.status_code}: {reply.text[:500]}")
                message = reply.json()["choices"][0]["message"]
                # templates that read a reply's text (Qwen3's) need a string where a tool-call reply has none
                messages.append({**message, "content": message.get("content") or ""})
                calls = message.get("tool_calls") or []
                if not calls:
                    return ProgramResult(exit_code=0, stdout="", stderr="")
                for call in calls:
                    messages.append(
                        {
                            "role": "tool",
                            "tool_call_id": call.get("id"),
                            "content": await _run(
                                servers, dispatch, call["function"]["name"], call["function"].get("arguments") or "{}"
                            ),
                        }
                    )


async def _run(servers: Any, dispatch: dict, name: str, arguments: str) -> Any:
    """One tool call's result, or what went wrong as its text (the model's to read, as verifiers' harnesses do)."""
    if name not in dispatch:
        return f"error: no tool named {name}; the tools are {', '.join(sorted(dispatch)) or 'none'}"
    try:
        args = json.loads(arguments)
        return await call_mcp(servers, dispatch, name, args if isinstance(args, dict) else {})
    except Exception as exc:  # noqa: BLE001 - a tool's failure is the model's to read
        return f"error: {type(exc).__name__}: {exc}"


__all__ = ["RlrunChat"]
