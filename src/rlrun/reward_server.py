"""Entry point: `python -m rlrun.reward_server --reward_file my_reward.py --port 5000` (a reward server for
`--remote_rm_url`; the server itself is rlrun.rewards.server)."""

import sys

from rlrun.rewards.server import main

if __name__ == "__main__":
    sys.exit(main())
