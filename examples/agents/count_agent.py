"""A black-box agent program for --agent_command (standard library only, so each episode starts in milliseconds):
turn 1 asks the chat API; turn 2 sends the conversation's ids verbatim plus an observation to vLLM's token route,
as verifiers' renderers client does. Its reward is the demo's rule: the share of the replies' characters that are
what the prompt's label asks for (digits or lowercase letters)."""

import json
import os
import string
import sys
import urllib.request

BASE, KEY, MODEL = os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"], os.environ["OPENAI_MODEL"]
ROOT = BASE.rsplit("/v1", 1)[0]  # the session's root: its token route is ROOT/inference/v1/generate
OBSERVATION = [10, 62, 32]  # "\n> ": what a tool's answer would add before the next turn


def post(url, body):
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


row = json.loads(sys.stdin.readline())
first = post(BASE + "/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": row["prompt"]}],
                                          "max_tokens": 6, "return_token_ids": True})
ids = first["prompt_token_ids"] + first["choices"][0]["token_ids"] + OBSERVATION
second = post(ROOT + "/inference/v1/generate", {"model": MODEL, "token_ids": ids,
                                                "sampling_params": {"max_tokens": 6, "logprobs": 1}})
# the byte tokenizer: id == byte value below 256 (then pad, bos, eos)
text = first["choices"][0]["message"]["content"] + bytes(
    t for t in second["choices"][0]["token_ids"] if t < 256).decode("utf-8", "replace")
targets = set(string.digits if row["label"] == "digits" else string.ascii_lowercase)
print(json.dumps({"reward": sum(c in targets for c in text) / max(1, len(text))}))
