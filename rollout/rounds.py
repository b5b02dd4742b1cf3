"""Generation batches fixed by the schedule, never by arrival time.

A local policy decodes a batch of requests much faster than the same requests one by one,
but on a CPU a row's logits change in their last bits with its batch mates
(rollout/policy.py), and those bits decide a token now and then: a batch cut by arrival
time makes the run depend on tool latency and machine load. Here a batch is a logical
round: every admitted trajectory that is still generating sends its next turn, and the
batch is cut only when all of them have, its rows in job order. A trajectory that stops
generating hands its place to the next job in the same call, so which trajectories meet
in a batch is a function of the jobs, the capacity (the runner's concurrency) and what
each one generated before: never of how fast a tool answered, a sandbox started or the
machine was. With per-request sampling keys (rollout/runner.py), a run is then the same
on an idle or a loaded machine, batch for batch.

The price is a barrier: a round waits for its slowest member's tool call. That is cheap
where tools are fast (math TIR's python tool, the embedded mode's sweeps); a job whose
tools take minutes (SWE in containers) keeps the per-request policy.
"""

from __future__ import annotations

import asyncio
from collections import deque

from rollout.policy import BatchPolicy, Generation, GenerationRequest, PolicyError, SamplingParams


class Rounds:
    """Admission and batching for `jobs` trajectories, `capacity` at a time (job order)."""

    def __init__(self, policy: BatchPolicy, capacity: int, jobs: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, not {capacity}")
        self.policy = policy
        self._waiting = deque(range(jobs))
        self._admitted = {position: asyncio.Event() for position in range(jobs)}
        self._members: set[int] = set()
        self._pending: dict[int, tuple[GenerationRequest, asyncio.Future[Generation]]] = {}
        self._decoding: set[asyncio.Task[None]] = set()
        for _ in range(min(capacity, jobs)):
            self._admit_next()

    def member(self, position: int) -> RoundMember:
        return RoundMember(self, position)

    def _admit_next(self) -> None:
        if self._waiting:
            position = self._waiting.popleft()
            self._members.add(position)
            self._admitted[position].set()

    async def _generate(self, position: int, request: GenerationRequest) -> Generation:
        if position not in self._members:
            raise PolicyError(f"job {position} generates outside its round membership")
        if position in self._pending:
            raise PolicyError(f"job {position} sent a second request in one round")
        future: asyncio.Future[Generation] = asyncio.get_running_loop().create_future()
        self._pending[position] = (request, future)
        self._cut_if_complete()
        try:
            return await future
        finally:
            # cancelled before its round was cut (a trajectory's deadline): not decoded
            if position in self._pending and self._pending[position][1] is future:
                del self._pending[position]

    def _leave(self, position: int) -> None:
        if position not in self._members:
            return
        self._members.discard(position)
        if (pending := self._pending.pop(position, None)) is not None:
            pending[1].cancel()  # left while its request waited: nobody will decode it
        self._admit_next()
        self._cut_if_complete()

    def _cut_if_complete(self) -> None:
        if not self._pending or len(self._pending) < len(self._members):
            return
        batch = [self._pending.pop(position) for position in sorted(self._pending)]
        task = asyncio.get_running_loop().create_task(self._decode(batch))
        self._decoding.add(task)
        task.add_done_callback(self._decoding.discard)

    async def _decode(
        self, batch: list[tuple[GenerationRequest, asyncio.Future[Generation]]]
    ) -> None:
        try:
            results = await self.policy.generate_batch([request for request, _ in batch])
        except Exception as error:  # every member of the batch learns of it
            failure = error if isinstance(error, PolicyError) else PolicyError(str(error))
            for _, future in batch:
                if not future.done():
                    future.set_exception(failure)
            return
        for (_, future), result in zip(batch, results, strict=True):
            if not future.done():
                future.set_result(result)


class RoundMember:
    """One job's place in the rounds: wait to be admitted, generate, leave (idempotent:
    when it stops generating, and again however its trajectory ends)."""

    def __init__(self, rounds: Rounds, position: int) -> None:
        self.rounds = rounds
        self.position = position

    async def admitted(self) -> None:
        await self.rounds._admitted[self.position].wait()

    async def generate(
        self, input_ids: list[int], params: SamplingParams, session_id: str | None = None
    ) -> Generation:
        request = GenerationRequest(input_ids, params, session_id)
        return await self.rounds._generate(self.position, request)

    def leave(self) -> None:
        self.rounds._leave(self.position)
