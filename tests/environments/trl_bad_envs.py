"""TRL environment classes that break TRL's contract, one way each."""


class NoReset:
    def step(self, text: str) -> str:
        """Step.

        Args:
            text: The text.
        """
        return text


class UndocumentedTool:
    def reset(self, **kwargs):
        return None

    def guess(self, number):
        return str(number)

    def get_reward(self) -> float:
        return 0.0


class NoReward:
    def reset(self, **kwargs):
        return None


class BrokenConstructor:
    def __init__(self):
        raise RuntimeError("no database")
