"""rlrun's verifiers harness, id `rlrun-chat` (--env_harness's default): the task's prompt as one chat request
through the episode's own endpoint, in process (verifiers' shipped harnesses start programs with uv, which needs the
network); verifiers records the call's tokens itself. A top-level package of rlrun's distribution because verifiers
resolves a harness id to a top-level module (`rlrun-chat` -> `rlrun_chat`), never to a dotted one."""

from __future__ import annotations

from typing import Any

import httpx
import verifiers.v1 as vf
from verifiers.v1.runtimes import ProgramResult


class RlrunChatConfig(vf.HarnessConfig):
    pass


class RlrunChat(vf.Harness[RlrunChatConfig]):
    NEEDS_CONTAINER = False
    EXECUTES_CODE = False
    APPENDS_SYSTEM_PROMPT = True

    async def launch(
        self, ctx: Any, trace: Any, runtime: Any, endpoint: str, secret: str, mcp_urls: Any, data: Any, **kwargs: Any
    ) -> Any:
        system, prompt = self.resolve_prompt(data)
        if isinstance(prompt, str):
            messages: list[Any] = [{"role": "user", "content": prompt}]
        else:
            messages = [m if isinstance(m, dict) else m.model_dump(exclude_none=True) for m in prompt or []]
        if system:
            messages = [{"role": "system", "content": system}, *messages]
        async with httpx.AsyncClient(timeout=None) as client:  # the episode's own timeout bounds it (verifiers')
            reply = await client.post(
                f"{endpoint}/chat/completions",
                headers={"Authorization": f"Bearer {secret}"},
                json={"model": ctx.model, "messages": messages},
            )
        if reply.status_code != 200:
            return ProgramResult(exit_code=1, stdout="", stderr=f"HTTP {reply.status_code}: {reply.text[:500]}")
        return ProgramResult(exit_code=0, stdout="", stderr="")


__all__ = ["RlrunChat"]
