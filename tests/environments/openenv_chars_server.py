"""An OpenEnv 0.10 environment written as its users write one (create_app over an Environment, served by uvicorn in
the OpenEnv lane): reset(label=...) asks for digits or letters; each step rewards the share of the reply's
characters that are what was asked, and the episode ends after two steps. Run: uvicorn openenv_chars_server:app."""

import string

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State


class ReplyAction(Action):
    message: str


class TaskObservation(Observation):
    text: str = ""


class CharsEnv(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        self._state = State(episode_id="", step_count=0)
        self.label = "digits"

    def reset(self, seed=None, episode_id=None, label="digits", **kwargs):
        if label == "broken":
            raise RuntimeError("no such game")
        self.label = label
        self._state = State(episode_id=episode_id or "episode", step_count=0)
        return TaskObservation(text=f"Reply with {label} only.", done=False, reward=0.0)

    def step(self, action, timeout_s=None, **kwargs):
        self._state.step_count += 1
        targets = set(string.digits if self.label == "digits" else string.ascii_lowercase)
        share = sum(c in targets for c in action.message) / max(1, len(action.message))
        done = self._state.step_count >= 2
        return TaskObservation(text="" if done else "Once more.", done=done, reward=share)

    @property
    def state(self):
        return self._state


app = create_app(CharsEnv, ReplyAction, TaskObservation, env_name="chars", max_concurrent_envs=64)


class OneSessionCharsEnv(CharsEnv):
    SUPPORTS_CONCURRENT_SESSIONS = False


# As most OpenEnv servers are made: create_app's defaults, one WebSocket session at a time
single = create_app(OneSessionCharsEnv, ReplyAction, TaskObservation, env_name="chars")
