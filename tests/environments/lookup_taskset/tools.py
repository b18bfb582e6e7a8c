"""The taskset's tool server (an MCP server verifiers starts per rollout: python -m lookup_taskset.tools)."""

import verifiers.v1 as vf

CODES = {"red": "4417", "blue": "9023"}


class LookupToolset(vf.Toolset[vf.ToolsetConfig]):
    @vf.tool
    def lookup(self, color: str) -> str:
        """The secret code of a color."""
        if color not in CODES:
            raise ValueError(f"no code for {color!r}")
        return CODES[color]


if __name__ == "__main__":
    LookupToolset.run()
