"""A verifiers 0.4 taskset written as its users write one, for the demo policy: "Write only digits/letters", rewarded
by the share of the reply's characters that are what the task asks for, plus an unweighted metric (the reply's
length). Its id is its package name, `chars_taskset`: put examples/tasksets on PYTHONPATH (docs/environments.md)."""

import string

import verifiers.v1 as vf


class CharData(vf.TaskData):
    label: str = "digits"


def reply(trace: vf.Trace) -> str:
    """The last assistant message of the trace's last branch."""
    for branch in reversed(trace.branches):
        for message in reversed(branch.messages):
            if getattr(message, "role", None) == "assistant":
                return str(message.content or "")
    return ""


class CharTask(vf.Task[CharData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def share(self, task: CharData, trace: vf.Trace) -> float:
        text = reply(trace)
        targets = set(string.digits if task.label == "digits" else string.ascii_lowercase)
        return sum(c in targets for c in text) / max(1, len(text))

    @vf.metric
    async def length(self, trace: vf.Trace) -> float:
        return float(len(reply(trace)))


class CharTaskset(vf.Taskset[CharTask, vf.TasksetConfig]):
    def load(self):
        for i in range(32):
            label = ("digits", "letters")[i % 2]
            yield CharTask(CharData(prompt=f"Write only {label} ({i}):", label=label))


__all__ = ["CharTaskset"]
