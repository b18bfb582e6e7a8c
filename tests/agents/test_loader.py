"""--agent_func_path: OpenRLHF agent files load unchanged (their `openrlhf.utils.agent` import is served by
rlrun when OpenRLHF is absent), and broken files are one clear AgentError."""

from __future__ import annotations

import asyncio
import textwrap
from pathlib import Path

import pytest

from rlrun.agents.loader import load_agent_file
from rlrun.runtime.errors import AgentError

REPO = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, body: str) -> str:
    path = tmp_path / "agent_func.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


def test_the_example_openrlhf_file_loads_and_steps() -> None:
    cls = load_agent_file(str(REPO / "examples" / "multiturn_agent.py"))
    agent = cls()
    first = asyncio.run(agent.step({"observation_text": "Write some digits:", "action_text": "12a4",
                                    "label": "digits", "sampling_params": None}))
    assert float(first["rewards"]) == pytest.approx(0.5 * 3 / 4)
    assert first["environment_feedback"] == "\nNow letters:" and first["done"] is False


def test_instance_class_without_executor(tmp_path: Path) -> None:
    path = write(tmp_path, """
        from openrlhf.utils.agent import AgentInstanceBase
        class AgentInstance(AgentInstanceBase):
            def __init__(self): pass
            async def step(self, states, **kwargs):
                return {"rewards": 1.0, "environment_feedback": "", "done": True}
    """)
    assert load_agent_file(path).__name__ == "AgentInstance"


@pytest.mark.parametrize("body, message", [
    ("x = 1\n", "defines neither AgentInstance"),
    ("""
     from openrlhf.utils.agent import AgentExecutorBase
     class AgentExecutor(AgentExecutorBase):
         def __init__(self, max_steps, max_length, llm_engine, hf_tokenizer, result_queue): pass
         async def execute(self, *args): pass
     """, "cannot run a custom execute"),
    ("""
     class AgentInstance:
         async def reset(self, states, **kwargs): return states
         def step(self, states, **kwargs): return {}
     """, "must be `async def step"),
    ("import no_such_module_xyz\n", "failed to import: ModuleNotFoundError"),
])
def test_broken_agent_files(tmp_path: Path, body: str, message: str) -> None:
    with pytest.raises(AgentError, match=message) as err:
        load_agent_file(write(tmp_path, body))
    assert "\n" not in str(err.value)


def test_missing_or_non_python_file(tmp_path: Path) -> None:
    with pytest.raises(AgentError, match="does not exist"):
        load_agent_file(str(tmp_path / "nope.py"))
    with pytest.raises(AgentError, match=r"a Python file \(\.py\)"):
        load_agent_file(str(tmp_path / "agent.txt"))
