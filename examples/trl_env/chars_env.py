"""A TRL environment class for the demo task, written to TRL's environment_factory contract (nothing here knows
rlrun): reset(**row) reads the row's `label` column and adds nothing to the prompt; `count_digits` is a tool the
model may call (the demo model never does); get_reward() gives 0.5 for an episode it was reset for, which the run
adds to its reward function's score (--remote_rm_url demo: the share of asked-for characters), as TRL adds an
environment's reward to its reward_funcs'."""


class CharsEnv:
    def __init__(self):
        self.label = None

    def reset(self, **kwargs):
        self.label = kwargs["label"]
        return None

    def count_digits(self, text: str) -> int:
        """Count the digits in a text.

        Args:
            text: The text to count in.
        """
        return sum(c.isdigit() for c in text)

    def get_reward(self) -> float:
        return 0.5 if self.label in ("digits", "letters") else 0.0
