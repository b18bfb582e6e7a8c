"""A tool-using verifiers 0.4 taskset, written as `vf init --add-tool` lays one out: each task asks for a color's
secret code, which only the `lookup` tool (an MCP server of the taskset's, tools.py) knows; the reward is 1 when the
final reply holds the code. Its id is its package name (tests/environments on the path)."""

import verifiers.v1 as vf

from lookup_taskset.tools import CODES, LookupToolset


class LookupData(vf.TaskData):
    color: str = "red"


class LookupTaskConfig(vf.TaskConfig):
    tools: vf.ToolsetConfig = vf.ToolsetConfig()


class LookupTask(vf.Task[LookupData, vf.State, LookupTaskConfig]):
    @classmethod
    def toolsets(cls, config: LookupTaskConfig) -> list[vf.Toolset]:
        return [LookupToolset(config.tools)]

    @vf.reward(weight=1.0)
    async def found(self, task: LookupData, trace: vf.Trace) -> float:
        code = CODES.get(task.color)
        return float(code is not None and code in trace.last_reply)


class LookupConfig(vf.TasksetConfig):
    task: LookupTaskConfig = LookupTaskConfig()


class LookupTaskset(vf.Taskset[LookupTask, LookupConfig]):
    def load(self) -> list[LookupTask]:
        return [LookupTask(LookupData(prompt=f"What is the code of {c}?", color=c), self.config.task)
                for c in ("red", "blue", "green")]


__all__ = ["LookupTaskset"]
