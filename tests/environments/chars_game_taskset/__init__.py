"""A multi-turn verifiers 0.4 taskset with an env of its own, written as verifiers' TextArena taskset is: the env's
`run()` plays the user host-side, seat `player`; each reply is scored by the share of its characters that are what
the task asks for (digits or letters), and the player is told "Once more." until the task's rounds (2 or 3) are
played; the reward is the sum of the shares. Its id is its package name (tests/environments on the path)."""

import string

import verifiers.v1 as vf


class GameData(vf.TaskData):
    label: str = "digits"
    rounds: int = 2


class GameTask(vf.Task[GameData, vf.State, vf.TaskConfig]):
    pass


def share(text: str, label: str) -> float:
    targets = set(string.digits if label == "digits" else string.ascii_lowercase)
    return sum(c in targets for c in text) / max(1, len(text))


class GameEnvConfig(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig()


class GameEnv(vf.Env[GameEnvConfig]):
    async def run(self, task, agents):
        shares = []
        async with agents.player.interaction(task) as interaction:
            segment = await interaction.turn()
            while not segment.terminated:
                shares.append(share(segment.last_reply, task.data.label))
                if len(shares) == task.data.rounds:
                    break
                segment = await interaction.turn("Once more.")
        interaction.trace.record_reward("shares", sum(shares), 1.0)
        interaction.trace.record_metric("rounds", float(len(shares)))


class GameTaskset(vf.Taskset[GameTask, vf.TasksetConfig]):
    def load(self):
        for i in range(8):
            label = ("digits", "letters")[i % 2]
            yield GameTask(GameData(prompt=f"Write only {label}:", label=label, rounds=2 + i % 3 // 2), self.config.task)


__all__ = ["GameData", "GameEnv", "GameEnvConfig", "GameTask", "GameTaskset"]
