"""A taskset with one task whose prompt does not fit the run's context (tests/environments/test_tasksets.py): its
episode fails at the gateway (400, context_length_exceeded), the others run."""

import verifiers.v1 as vf


class ShortTask(vf.Task[vf.TaskData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def one(self, trace: vf.Trace) -> float:
        return 1.0


class MixedTaskset(vf.Taskset[ShortTask, vf.TasksetConfig]):
    def load(self):
        for i in range(4):
            yield ShortTask(vf.TaskData(prompt="x" * 400 if i == 2 else f"hello {i}"))


__all__ = ["MixedTaskset"]
