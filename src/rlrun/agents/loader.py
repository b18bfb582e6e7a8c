"""--agent_func_path: an OpenRLHF agent file -> a factory of agent instances.

OpenRLHF agent files import `openrlhf.utils.agent`; when OpenRLHF is not installed, that module name
is served by rlrun.agents.api while the file loads, so the file runs unchanged."""

from __future__ import annotations

import importlib.util
import inspect
import sys
import types
from collections.abc import Callable

from rlrun.agents import api
from rlrun.agents.calls import Instance
from rlrun.runtime.errors import AgentError
from rlrun.runtime.pyfile import import_file, one_line

DEFINES = "class AgentInstance(AgentInstanceBase) with async reset()/step() (OpenRLHF's agent contract)"


def _provide_openrlhf_names() -> None:
    """Make `from openrlhf.utils.agent import AgentInstanceBase, ...` work without OpenRLHF."""
    if "openrlhf.utils.agent" in sys.modules:
        return
    try:
        if importlib.util.find_spec("openrlhf") is not None:
            return  # the real package: its base classes are duck-typed below
    except (ImportError, ValueError):
        pass
    for name in ("openrlhf", "openrlhf.utils"):
        if name not in sys.modules:
            package = types.ModuleType(name)
            package.__path__ = []  # a package, so the submodule import resolves
            sys.modules[name] = package
    sys.modules["openrlhf.utils.agent"] = api
    sys.modules["openrlhf.utils"].agent = api  # type: ignore[attr-defined]


def _instance_class(module: types.ModuleType, path: str) -> type:
    executor = getattr(module, "AgentExecutor", None)
    if executor is not None:
        bound = None
        try:
            bound = getattr(executor(), "agent_instance_cls", None) if inspect.isclass(executor) else None
        except TypeError:
            pass  # an executor whose __init__ needs arguments drives the engine itself: rejected below
        except Exception as exc:
            raise AgentError(f"agent file {path}: AgentExecutor() raised {one_line(exc)}") from exc
        if bound is not None:
            return bound
        if getattr(module, "AgentInstance", None) is None:
            raise AgentError(
                f"agent file {path}: AgentExecutor does not bind an AgentInstance class "
                "(MultiTurnAgentExecutor.__init__(AgentInstance)); rlrun drives the turns itself and "
                "cannot run a custom execute(). Define AgentInstance with reset()/step()."
            )
    cls = getattr(module, "AgentInstance", None)
    if not inspect.isclass(cls):
        raise AgentError(
            f"agent file {path} defines neither AgentInstance nor an AgentExecutor bound to one; define {DEFINES}."
        )
    return cls


def load_agent_file(path: str) -> Callable[[], Instance]:
    """The AgentInstance class of an OpenRLHF agent file (a factory: one instance per episode)."""
    if not path.endswith(".py"):
        raise AgentError(f"--agent_func_path {path}: an agent is a Python file (.py) defining {DEFINES}")
    _provide_openrlhf_names()
    cls = _instance_class(import_file(path, "agent file", AgentError, DEFINES), path)
    for method in ("reset", "step"):
        if not inspect.iscoroutinefunction(getattr(cls, method, None)):
            raise AgentError(
                f"agent file {path}: {cls.__name__}.{method} must be `async def {method}(self, states, "
                f"**kwargs)` "
                "(OpenRLHF's contract)"
            )
    return cls
