"""--partial_rollout: one engine rank's sequences in flight across weight syncs.

A synchronous step waits for its longest response, so with long-tailed lengths most decode steps run a nearly
empty batch. Here an engine holds up to --max_staleness steps' rows (generating or finished); a step takes the
first whole groups (all n samples of a prompt) to finish, finished groups are replaced by new prompts, and the
unfinished rows carry over the weight sync and continue (their prompt plus the tokens so far, prefilled again,
under the new weights) as OpenRLHF's partial rollout and verl's fully-async rollouter do; while the learners
train, the engine goes on with its unfinished rows until they say they have. Every token remembers the policy
version that sampled it, so a step knows each row's staleness; a group holding a token more than
--max_staleness versions older than the policy that trains on it is restarted from its prompt (verl throttles
instead; OpenRLHF bounds nothing).

Bookkeeping around the engine's sampling. Its only collectives are the callables the caller passes: the learners'
flag, and, for a tensor-parallel engine, the vote that keeps the engine's ranks calling the engine together.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from rlrun.data.batching import derive_seed, shard
from rlrun.data.prompts import PromptSampler
from rlrun.engines.protocol import Engine, SamplesUntil


@dataclass
class InFlightRow:
    """One response being generated: its prompt record, the tokens so far with each one's engine log-prob
    and the policy version that sampled it."""

    record: int
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    done: bool = False
    restarted: bool = False

    def restart(self) -> None:
        self.tokens, self.log_probs, self.versions, self.done, self.restarted = [], [], [], False, True

    def staleness(self, trained_version: int) -> int:
        """How many versions the oldest token lags the policy trained on it (0: sampled by that policy)."""
        return trained_version - min(self.versions) if self.versions else 0


@dataclass(frozen=True)
class PoolSettings:
    n_samples: int  # rows per group (one prompt)
    prompts_per_step: int  # this engine's prompts per step (--rollout_batch_size / engines)
    max_new_tokens: int  # --generate_max_len
    chunk_tokens: int  # --partial_rollout_tokens
    max_staleness: int  # --max_staleness
    end_ids: tuple[int, ...]  # the ids that end a response
    seed: int

    @property
    def rows_per_step(self) -> int:
        return self.n_samples * self.prompts_per_step


def alone(wants: bool) -> bool:
    """An engine of one rank decides by itself."""
    return wants


class SequencePool:
    """The rows one engine rank has in flight; take(step, version) returns a step's rows, generating as needed.

    `any_rank(wants)`: whether any rank of this rank's engine wants another generation round (the same answer on
    each). A tensor-parallel engine's ranks each keep a pool of their own prompts, but every call of the engine is
    collective over them, so they go round together while any of them needs to: a rank with enough finished groups
    continues its unfinished rows meanwhile (generation ahead, as while the learners train), or sends no rows."""

    def __init__(
        self,
        engine: Engine,
        prompt_ids: list[list[int]],
        sampler: PromptSampler,
        slot: int,
        engines: int,
        settings: PoolSettings,
        any_rank: Callable[[bool], bool] = alone,
    ) -> None:
        self.engine, self.prompt_ids, self.sampler = engine, prompt_ids, sampler
        self.slot, self.engines, self.s, self.any_rank = slot, engines, settings, any_rank
        self.active: list[list[InFlightRow]] = []  # groups being generated, in admission order
        self.ready: deque[list[InFlightRow]] = deque()  # finished groups, in finishing order
        self.waiting: deque[int] = deque()  # records admitted next
        self.next_prompt_step: int | None = None
        self.chunks = 0  # chunk calls so far: each draws from its own seed

    def take(self, step: int, version: int, trained: Callable[[], bool] | None = None) -> list[InFlightRow]:
        """The rows_per_step rows (whole groups) that step `step` trains on, sampling with the engine's current
        weights, which are policy version `version` (step - 1 while the learners train on the step before, or
        `step` itself for a synchronous first step). With `trained` (the learners' flag: True once they have
        trained), the engine goes on with its unfinished rows, a chunk at a time, until they have, or until those
        are finished."""
        if self.next_prompt_step is None:
            self.next_prompt_step = step
        self._restart_stale(step)
        while True:
            short = self._rows(self.ready) < self.s.rows_per_step
            if not self.any_rank(short):
                break
            if short:
                self._admit()
            self._advance(version, ahead=not short)  # a rank already served admits nothing: its new rows would wait
        # Ahead of the learners: continue the rows in flight (no new prompts: a row started now would wait behind
        # this step's finished groups and grow stale), so a later step finds them further along.
        while self.any_rank(
            trained is not None and not trained() and not all(row.done for g in self.active for row in g)
        ):
            self._advance(version, ahead=True)
        rows: list[InFlightRow] = []
        while len(rows) < self.s.rows_per_step:
            rows += self.ready.popleft()
        return rows

    @staticmethod
    def _rows(groups: Iterable[list[InFlightRow]]) -> int:
        return sum(len(g) for g in groups)

    def _restart_stale(self, step: int) -> None:
        """Groups that would train at `step` (or later) with a token older than --max_staleness allows start over;
        finished ones go back to the front of the generating groups."""
        oldest = step - self.s.max_staleness

        def stale(group: list[InFlightRow]) -> bool:
            return any(v < oldest for row in group for v in row.versions[:1])

        back = [g for g in self.ready if stale(g)]
        self.ready = deque(g for g in self.ready if not stale(g))
        for group in back + [g for g in self.active if stale(g)]:
            for row in group:
                row.restart()
        self.active = back + self.active

    def _admit(self) -> None:
        """Fill the free places with new groups: --max_staleness steps' rows held (generating or finished), since
        more could not be trained before they were too stale. More rows than one step takes is what lets a step
        go before its longest responses end: a GPU decodes twice the rows in about the time of one (memory-bound);
        a CPU does not, so there it costs about what it saves (bench/async_train.py)."""
        n = self.s.n_samples
        while self._rows(self.active) + self._rows(self.ready) + n <= self.s.rows_per_step * self.s.max_staleness:
            if not self.waiting:
                self._draw_prompts()
            record = self.waiting.popleft()
            self.active.append([InFlightRow(record, self.prompt_ids[record]) for _ in range(n)])

    def _draw_prompts(self) -> None:
        """This engine's prompts of the next prompt step: the sampler's order, which wraps around after its last
        step (the pool runs ahead of the training steps by the rows it has in flight)."""
        assert self.next_prompt_step is not None
        indices = self.sampler.indices(self.next_prompt_step % self.sampler.total_steps)
        self.waiting.extend(indices[shard(len(indices), self.engines, self.slot)])
        self.next_prompt_step += 1

    def _advance(self, version: int, *, ahead: bool = False) -> None:
        """Generate for every unfinished row: until enough groups finished to fill the step (rlrun's native engine
        stops its decode right there; other engines run one chunk of --partial_rollout_tokens), or, `ahead` of the
        learners, one chunk. Groups whose rows all finished move to `ready`."""
        rows = [row for group in self.active for row in group if not row.done]
        seed = derive_seed(self.s.seed, "partial_rollout", self.chunks, self.slot)
        self.chunks += 1
        prompts, cap, chunk = [row.prompt + row.tokens for row in rows], self.s.max_new_tokens, self.s.chunk_tokens
        room = [cap - len(row.tokens) for row in rows]
        if isinstance(self.engine, SamplesUntil):
            groups = [g for g, group in enumerate(self.active) for row in group if not row.done]
            if ahead:
                limits, need = [min(chunk, r) for r in room], len(self.active)
            else:
                limits, need = room, -(-(self.s.rows_per_step - self._rows(self.ready)) // self.s.n_samples)
            out, stopped = self.engine.sample_until(prompts, seed, limits, groups, need)
        else:
            limits = [chunk] * len(rows)
            out = self.engine.sample(prompts, seed, max_new_tokens=chunk)
            stopped = [True] * len(rows)
        log_probs = out.log_probs or [[0.0] * len(r) for r in out.responses]
        for row, new, lps, limit, end in zip(rows, out.responses, log_probs, limits, stopped):
            kept = new[: cap - len(row.tokens)]
            row.tokens += kept
            row.log_probs += lps[: len(kept)]
            row.versions += [version] * len(kept)
            # finished: it stopped short of its limit (EOS, a stop), sampled EOS, or reached --generate_max_len;
            # a row that ran to a chunk's end, or was still running when the decode stopped early, goes on
            row.done = end and (len(new) < limit or (bool(new) and new[-1] in self.s.end_ids)) or len(row.tokens) >= cap
        finished = [g for g in self.active if all(row.done for row in g)]
        self.active = [g for g in self.active if not all(row.done for row in g)]
        self.ready.extend(finished)
