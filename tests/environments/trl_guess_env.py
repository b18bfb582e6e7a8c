"""A TRL environment class written as TRL's docs write one (GRPOTrainer's environment_factory): reset(**row) reads
the row's `answer` column and returns text for the prompt; `guess` is the model's tool; get_reward owns the reward.
Nothing here knows rlrun."""

import time


class GuessEnv:
    def __init__(self):
        self.target = None
        self.guesses = []

    def reset(self, **kwargs) -> str:
        if kwargs.get("answer") == "sleep":
            time.sleep(30)
        self.target = int(kwargs["answer"])
        self.guesses = []
        return " Use the guess tool."

    def guess(self, number: int) -> str:
        """Guess the secret number.

        Args:
            number: The number to guess.

        Returns:
            Whether the secret number is higher, lower, or correct.
        """
        self.guesses.append(number)
        if number == self.target:
            return "Correct!"
        return "Higher." if number < self.target else "Lower."

    def get_reward(self) -> float:
        if self.target in self.guesses:
            return 1.0 / len(self.guesses)
        return 0.0
