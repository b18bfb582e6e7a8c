"""A verifiers 0.4 taskset with short verifiable answers, for a real small model (bench/real_env.py): "What is
a + b?" for two-digit a and b, rewarded 1 when the reply's last number is the sum. The 1,600 pairs (10..49 each) are
split once, by a fixed shuffle, into 1,400 training and 200 held-out tasks (`--env_args '{"split": "test"}'`), so the
held-out sums are never trained on. Its id is its package name, `sums_taskset`: put examples/tasksets on
PYTHONPATH."""

import random
import re

import verifiers.v1 as vf

NUMBER = re.compile(r"-?\d+")
HELD_OUT = 200


def last_number(text: str) -> int | None:
    """The reply's last integer (commas are not read: the sums are below 100)."""
    found = NUMBER.findall(text)
    return int(found[-1]) if found else None


def pairs(split: str) -> list[tuple[int, int]]:
    every = [(a, b) for a in range(10, 50) for b in range(10, 50)]
    random.Random(0).shuffle(every)
    return every[:HELD_OUT] if split == "test" else every[HELD_OUT:]


class SumData(vf.TaskData):
    answer: int = 0


class SumTask(vf.Task[SumData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def correct(self, task: SumData, trace: vf.Trace) -> float:
        return float(last_number(trace.last_reply) == task.answer)


class SumsConfig(vf.TasksetConfig):
    split: str = "train"


class SumsTaskset(vf.Taskset[SumTask, SumsConfig]):
    def load(self):
        if self.config.split not in ("train", "test"):
            raise ValueError(f"split {self.config.split!r}: use train or test")
        for a, b in pairs(self.config.split):
            yield SumTask(SumData(prompt=f"What is {a} + {b}? Answer with the number only.", answer=a + b))


__all__ = ["SumsTaskset"]
