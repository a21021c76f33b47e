"""Judge dispatch: turns whose pairing is resolved -> RewardPipeline -> sample status, asynchronously.

Role: the user's reply is never delayed by judging. The work queue IS the store (samples with status
``pending_judge``), so pending work survives a crash and a restart resumes it.

Contract:
- Each session's pending turns are processed serially in turn order (the at-least-one rule depends on
  the order); different sessions run concurrently, at most ``dispatch_concurrency`` at a time.
- ``session_has_included`` comes from the store; the outcome (an :class:`engine.records.PipelineOutcome`:
  status, reject_reason, Sample JSON) and the session's ``has_included`` flag are persisted in one transaction.
- A judge service that cannot be reached (``JudgeUnavailable``, also when the pipeline reports it as a
  ``judge_unavailable`` rejection) or an engine that is down (teacher ``EngineUnavailable``/
  ``EngineTimeout``) keeps the job ``pending_judge``: it is retried with capped exponential backoff
  (attempts and last error are stored and reported in stats), never dropped, never scored 0.
- Every Sample JSON carries ``constrained`` (bool, :func:`is_constrained`): true when the turn was
  sampled under a decoding constraint (a forced tool call or a JSON response format), whose rollout
  log-probs are the masked distribution's.
- Explicit feedback on the turn (policy_server.store.feedback) is read before judging: its text may serve as
  the hint (``feedback_hint``), its value is combined with the outcome under ``feedback_policy`` before the
  write, and feedback that arrived meanwhile is settled right after it (the store re-runs the at-least-one
  rule when that feedback excludes the session's last included sample).
- Any other pipeline exception rejects the turn with reason ``pipeline_error: ...`` (explicit, visible).
- The stored Sample is an :class:`engine.records.Sample` (the pipeline's fields, the turn's
  :data:`~engine.records.SAMPLE_TURN_KEYS`, the origin). A pipeline result off that schema is rejected
  ``pipeline_error: sample off the schema: <field>: <why>``, except an unusable number, which the store
  rejects as ``invalid_values: <why>`` like every other.
- A busy store (policy_server.errors.StoreBusy: another connection holds the SQLite write lock) defers the
  session's work with the same capped backoff; nothing was written, so it stays pending and is retried.
- Replicas on one shared store (``owner`` = this replica's id): a session's worker first claims the session
  (``Store.claim_session``, renewed while it runs, released when it ends), so one replica at a time judges
  a session, in turn order; the claim of a replica that died expires after ``claim_s`` and another replica
  finishes the work. Sessions another replica holds a live claim on are not scheduled here.
- Without a pipeline (no judge configured) jobs stay pending and are reported as such (held samples of an
  ended session are still scored).
- With PRM scoring on (``scoring``, policy_server.rewards.scoring), scope ``turn``: a turn the pipeline accepts is
  scored before the write: its ``token_rewards`` (or its ``prm_rejected: ...`` rejection) are stored in the
  same transaction as the status, so no sample is ever ``ready`` without them; a scorer dependency that is
  unreachable keeps the job pending (retried like an unreachable judge).
- Scope ``session``: an accepted turn is stored ``pending_score`` (held). A session's worker, once it has no
  ``pending_judge`` job left, scores the session if the store says it is scorable (ended, every turn
  decided: ``Store.scorable_sessions``) and writes every held sample's outcome in one transaction; an
  unreachable scorer dependency notes an attempt on the held samples and retries the session with the same
  capped backoff. Sessions that are only scorable (nothing to judge) are scheduled too, so held samples
  found at startup are scored after a restart (also when the server now runs with ``--prm-scope turn``:
  they were held for a session score and get one; without any PRM scoring they stay held, logged at start).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Protocol

from pydantic import ValidationError

from engine.errors import EngineTimeout, EngineUnavailable
from engine.observability import bind_ids
from engine.records import (
    SAMPLE_ORIGIN_KEYS,
    SAMPLE_TURN_KEYS,
    PipelineOutcome,
    PipelineTurn,
    RejectReason,
    Sample,
    SampleJSON,
    Turn,
    TurnRecord,
)
from engine.records import SampleState as S
from engine.sample_values import value_problem
from engine.tool_grammar import is_constrained as grammar_constrained
from engine.validation import describe_validation_errors
from judge_server.errors import JudgeUnavailable
from policy_server.errors import StoreBusy
from policy_server.rewards.scoring import PRMScoring, apply_outcome, held_outcomes, held_samples
from policy_server.store import SampleStore
from policy_server.store.feedback_rule import applicable, apply_feedback
from policy_server.store.records import JudgeJob

logger = logging.getLogger(__name__)

# An unreachable judge service or teacher engine is not a verdict: the turn stays pending and is retried
# (the client layer's retries of the engine and of the judge service are exhausted by then).
_RETRYABLE: tuple[type[BaseException], ...] = (EngineUnavailable, EngineTimeout, JudgeUnavailable)


def is_constrained(turn: TurnRecord) -> bool:
    """Whether the turn was sampled under a decoding constraint (a forced tool call: ``ebnf``; a JSON
    response format: ``json_schema``).

    Its rollout log-probs are then those of the engine's MASKED distribution, not the model's own, so
    the trainer must not compare them with recomputed log-probs. The turn record's ``constrained`` flag says
    so; turns recorded before that flag existed are recognised by their sampling params, by the same rule
    (engine.tool_grammar.is_constrained) that set the flag.
    """
    return turn.constrained or grammar_constrained(turn.sampling_params or {})


class TurnPipeline(Protocol):
    """What the dispatcher needs of the reward pipeline (policy_server.rewards.modes.RewardPipeline)."""

    async def process(
        self,
        turn: PipelineTurn,
        next_state: list[dict[str, object]] | None,
        *,
        session_has_included: bool,
        session_done: bool,
    ) -> PipelineOutcome: ...


class Dispatcher:
    """Polls the store for pending_judge samples; woken early by :meth:`wake`."""

    def __init__(
        self,
        store: SampleStore,
        pipeline: TurnPipeline | None,
        *,
        concurrency: int,
        retry_initial_s: float,
        retry_max_s: float,
        claim_s: float,
        poll_s: float = 1.0,
        scoring: PRMScoring | None = None,
        owner: str | None = None,
        feedback_policy: str = "override",
        feedback_hint: bool = True,
        at_least_one: bool = True,
    ):
        """``concurrency`` .. ``claim_s``: the ``dispatch_*`` settings of PolicySettings (defaults live there);
        ``poll_s``: how often the store is polled when nothing wakes the dispatcher; ``feedback_policy`` /
        ``feedback_hint``: how explicit feedback combines with the verdict (policy_server.store.feedback_rule);
        ``at_least_one``: the setting, for feedback settled after judging (the store re-runs the rule)."""
        self.store = store
        self.owner = owner
        self.feedback_policy = feedback_policy
        self.feedback_hint = feedback_hint
        self.at_least_one = at_least_one
        self.claim_s = claim_s
        self.pipeline = pipeline
        self.scoring = scoring
        self.concurrency = concurrency
        self.retry_initial_s = retry_initial_s
        self.retry_max_s = retry_max_s
        self.poll_s = poll_s
        self._wake = asyncio.Event()
        self._closed = False
        self._running: dict[str, asyncio.Task[None]] = {}
        self._sem = asyncio.Semaphore(concurrency)
        self._retry_at: dict[str, float] = {}
        self.processed = 0
        self.retries = 0
        self.outcomes: dict[str, int] = {}

    def wake(self) -> None:
        self._wake.set()

    @property
    def running_sessions(self) -> int:
        """How many session workers run now (``dispatch.running_sessions`` in the stats)."""
        return len(self._running)

    async def run(self) -> None:
        # The flag, not only task.cancel(), ends the loop: in Python 3.11 a cancel() that races with the
        # wake event completing inside asyncio.wait_for is swallowed, and the loop would go on forever.
        while not self._closed:
            self._wake.clear()
            try:
                await self.schedule()
            except Exception:  # keep dispatching after a transient store error; retried next tick
                logger.exception("dispatch scheduling failed")
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=self.poll_s)
            except TimeoutError:
                pass

    @property
    def session_scope(self) -> bool:
        return self.scoring is not None and self.scoring.scope == "session"

    async def _work_sessions(self) -> set[str]:
        """Sessions with something to do: pending_judge jobs (with a pipeline), or held samples ready to be scored."""
        sessions: set[str] = set()
        if self.pipeline is not None:
            sessions.update(j.session_id for j in await asyncio.to_thread(self.store.pending_jobs, self.owner))
        if self.scoring is not None:  # also in turn scope: samples held by an earlier session-scope run
            sessions.update(await asyncio.to_thread(self.store.scorable_sessions, None, self.owner))
        return sessions

    async def schedule(self) -> int:
        """Start a worker for every session with pending work and none running; returns how many."""
        sessions = await self._work_sessions()
        now = time.monotonic()
        started = 0
        for sid in sorted(sessions):
            if sid in self._running or self._retry_at.get(sid, 0.0) > now:
                continue
            self._running[sid] = asyncio.create_task(self._session_worker(sid), name=f"judge-{sid}")
            started += 1
        return started

    async def drain(self, timeout_s: float) -> None:
        """Wait until every running session worker finished (tests, shutdown)."""
        if self._running:
            await asyncio.wait(list(self._running.values()), timeout=timeout_s)

    async def shutdown(self, drain_s: float) -> dict[str, int]:
        """Bounded drain before exit: keep judging (the run loop keeps scheduling) until nothing is runnable
        (no worker running and every pending session is in retry backoff, or none is pending) or ``drain_s``
        passed; then cancel what still runs. A cancelled worker's sample stays pending_judge: its outcome is
        written in one transaction or not at all. Returns counts for the shutdown log."""
        end = time.monotonic() + drain_s
        done_before = self.processed
        self.wake()
        while (self.pipeline is not None or self.scoring is not None) and time.monotonic() < end:
            if not self._running:
                try:
                    sessions = await self._work_sessions()
                except StoreBusy:  # a locked store cannot be drained: what is pending stays pending
                    break
                now = time.monotonic()
                if not any(self._retry_at.get(sid, 0.0) <= now for sid in sessions):
                    break
                self.wake()
            await asyncio.sleep(0.05)
        cancelled = len(self._running)
        await self.aclose()
        return {"judged": self.processed - done_before, "cancelled": cancelled}

    async def aclose(self) -> None:
        self._closed = True
        self.wake()
        for t in list(self._running.values()):
            t.cancel()
        await asyncio.gather(*self._running.values(), return_exceptions=True)

    async def _session_worker(self, session_id: str) -> None:
        # The session id on every log line of this background work, and forwarded to the judge/teacher.
        with bind_ids(session_id=session_id):
            if self.owner is None:
                await self._session_jobs(session_id)
                return
            try:
                if not await asyncio.to_thread(self.store.claim_session, session_id, self.owner, self.claim_s):
                    self._running.pop(session_id, None)
                    return  # another replica works on this session; its claim expires if it dies
            except StoreBusy as exc:
                logger.warning("session %s: judge work deferred: %s", session_id, exc)
                self._running.pop(session_id, None)
                self._back_off(session_id, 3)
                return
            heartbeat = asyncio.create_task(self._renew_claim(session_id), name=f"claim-{session_id}")
            try:
                await self._session_jobs(session_id)
            finally:
                heartbeat.cancel()
                with contextlib.suppress(StoreBusy):  # an unreleased claim just expires after claim_s
                    await asyncio.to_thread(self.store.release_session, session_id, self.owner)

    async def _renew_claim(self, session_id: str) -> None:
        """Keep this replica's claim alive while its worker runs (a slow judge call outlasts one claim)."""
        assert self.owner is not None, "claims are only taken with an owner"
        while True:
            await asyncio.sleep(self.claim_s / 3)
            try:
                if not await asyncio.to_thread(self.store.claim_session, session_id, self.owner, self.claim_s):
                    # Taken over after we stalled past the claim: outcomes are still decided once
                    # (complete_judge only moves pending_judge), so the duplicate work is only wasted.
                    logger.warning("session %s: judge claim lost to another replica", session_id)
                    return
            except StoreBusy as exc:
                logger.warning("session %s: claim renewal deferred: %s", session_id, exc)

    async def _session_jobs(self, session_id: str) -> None:
        try:
            async with self._sem:
                while True:
                    jobs = (
                        []
                        if self.pipeline is None
                        else [
                            j
                            for j in await asyncio.to_thread(self.store.pending_jobs, self.owner)
                            if j.session_id == session_id
                        ]
                    )
                    if not jobs:
                        if self.scoring is None:
                            return
                        attempts = await self._score_session(session_id)
                        if attempts is None:
                            self._retry_at.pop(session_id, None)
                            return
                    else:
                        attempts = None if await self._process(jobs[0]) else jobs[0].attempts
                    if attempts is not None:
                        self._back_off(session_id, attempts)
                        return
                    self._retry_at.pop(session_id, None)
        except StoreBusy as exc:
            # The store is locked by someone else: nothing was written, the work stays pending; try later.
            logger.warning("session %s: judge work deferred: %s", session_id, exc)
            self._back_off(session_id, 3)
        finally:
            self._running.pop(session_id, None)

    def _back_off(self, session_id: str, attempts: int) -> None:
        delay = min(self.retry_max_s, self.retry_initial_s * 2 ** min(attempts, 10))
        self._retry_at[session_id] = time.monotonic() + delay
        asyncio.get_running_loop().call_later(delay, self.wake)

    async def _process(self, job: JudgeJob) -> bool:
        """Judge one turn; returns False when it must be retried later."""
        turn = await asyncio.to_thread(self.store.get_turn, job.session_id, job.turn_index)
        session = await asyncio.to_thread(self.store.session, job.session_id)
        if turn is None or session is None:  # the session was deleted meanwhile: nothing left to judge
            return True
        assert self.pipeline is not None, "pending jobs are only processed with a pipeline"
        feedback = await asyncio.to_thread(self.store.turn_feedback, job.session_id, job.turn_index)
        hint = feedback.text if feedback is not None and feedback.text and self.feedback_hint else None
        pipeline_turn = PipelineTurn.of(turn, feedback_hint=hint)
        try:
            result = await self.pipeline.process(
                pipeline_turn,
                turn.next_state,
                session_has_included=session.has_included,
                session_done=turn.session_done,
            )
        except _RETRYABLE as exc:
            return await self._retry_later(job, f"{type(exc).__name__}: {exc}")
        except Exception as exc:  # a pipeline bug must not stall the session: reject visibly
            logger.exception("reward pipeline failed on %s/%s", job.session_id, job.turn_index)
            result = _pipeline_error(exc)
        reason = result.reject_reason or ""
        if result.status == S.REJECTED and reason.startswith(RejectReason.JUDGE_UNAVAILABLE):
            return await self._retry_later(job, reason)
        if self.session_scope and result.status == S.READY:
            result = result.held()  # held until the whole session is scored
        elif self.scoring is not None and result.status == S.READY:
            outcome = await self.scoring.score_turn(turn, result.sample.prm)
            if outcome.kind == "retry":
                return await self._retry_later(job, f"prm: {outcome.reason}")
            result = apply_outcome(result, outcome)
        raw = _sample_json(result.sample.to_json(), turn, job.sample_id)
        if feedback is not None and applicable(result.status, result.reject_reason):
            # Feedback that arrived before judging is part of the outcome written now (never leased without it).
            status, why, raw = apply_feedback(
                result.status,
                result.reject_reason,
                raw,
                value=feedback.value,
                text=feedback.text,
                policy=self.feedback_policy,
                count=feedback.count,
            )
            included = status in (S.READY, S.PENDING_SCORE)
            result = result.model_copy(update={"status": status, "reject_reason": why, "included": included})
        try:
            data = Sample.model_validate(raw)
        except ValidationError as exc:
            # Off the schema, the sample cannot be stored: an unusable value is rejected with its own reason
            # (invalid_values: ..., as the store names it for a value the schema admits); any other departure is a
            # pipeline bug. Either is rejected visibly, keeping only the turn's fields.
            why = value_problem(raw)
            if why is None:
                logger.error("sample of %s/%s is off the schema: %s", job.session_id, job.turn_index, exc)
                result = _pipeline_error(exc)
            else:
                result = PipelineOutcome.rejected(RejectReason.with_detail(RejectReason.INVALID_VALUES, why))
            data = Sample.model_validate(_sample_json({}, turn, job.sample_id))
        await asyncio.to_thread(
            self.store.complete_judge,
            job.sample_id,
            status=result.status,
            reject_reason=result.reject_reason,
            included=result.included,
            data=data,
        )
        # Feedback that arrived while the judge ran is applied now (or counted late if already leased).
        await asyncio.to_thread(
            self.store.settle_feedback, job.session_id, job.turn_index, self.feedback_policy, self.at_least_one
        )
        self.processed += 1
        self.outcomes[result.status] = self.outcomes.get(result.status, 0) + 1
        return True

    async def _score_session(self, session_id: str) -> int | None:
        """Score the session's held samples if it is scorable; None when done (or nothing to do), else the
        attempts so far (for the backoff) after noting this failed try on the held samples."""
        if not await asyncio.to_thread(self.store.scorable_sessions, session_id):
            return None
        trajectory = await asyncio.to_thread(self.store.session_trajectory, session_id)
        held = [sample for _, sample in held_samples(trajectory)]
        if not held:
            return None
        assert self.scoring is not None, "held samples are only scored with PRM scoring on"
        outcome = await self.scoring.score_held_session(trajectory)
        if outcome.kind == "retry":
            self.retries += 1
            attempts = max(s.attempts for s in held)
            logger.warning(
                "scoring session %s deferred (attempt %d, %d held): %s",
                session_id,
                attempts + 1,
                len(held),
                outcome.reason,
            )
            await asyncio.to_thread(self.store.note_score_attempt, session_id, f"prm: {outcome.reason}")
            return attempts
        rows = held_outcomes(trajectory, outcome)
        moved = await asyncio.to_thread(self.store.complete_score, rows)
        status = S.READY if outcome.kind == "scored" else S.REJECTED
        self.outcomes[status] = self.outcomes.get(status, 0) + moved
        logger.info(
            "scored session %s: %d held sample(s) %s",
            session_id,
            moved,
            status if outcome.kind == "scored" else f"{status} ({outcome.reason})",
        )
        return None

    async def _retry_later(self, job: JudgeJob, error: str) -> bool:
        self.retries += 1
        logger.warning(
            "judging %s/%s deferred (attempt %d): %s", job.session_id, job.turn_index, job.attempts + 1, error
        )
        await asyncio.to_thread(self.store.note_attempt, job.sample_id, error)
        return False


def _sample_json(fields: SampleJSON, turn: Turn, sample_id: str) -> SampleJSON:
    """The stored Sample's JSON: the pipeline's fields, then the turn's (:data:`SAMPLE_TURN_KEYS`), then its
    origin (:data:`SAMPLE_ORIGIN_KEYS`): the :class:`~engine.records.Sample` field order. The origin's
    session, index and time are the turn's; the id is the sample row's, ``constrained`` :func:`is_constrained`.
    A field the stored record lacks is null in the Sample (the trainer sets such a sample aside), not its
    empty default: hence the turn's JSON, which keeps absent keys absent."""
    recorded = turn.to_json()
    origin = {**recorded, "sample_id": sample_id, "constrained": is_constrained(turn)}
    return {
        **fields,
        **{k: recorded.get(k) for k in SAMPLE_TURN_KEYS},
        **{k: origin[k] for k in SAMPLE_ORIGIN_KEYS},
    }


def _pipeline_error(exc: Exception) -> PipelineOutcome:
    """A pipeline failure (a bug, or a sample off the schema) as a visible rejection, never a score."""
    if isinstance(exc, ValidationError):
        detail = f"sample off the schema: {describe_validation_errors(exc.errors(), limit=1)}"
    else:
        detail = f"{type(exc).__name__}: {exc}"
    return PipelineOutcome.rejected(RejectReason.with_detail(RejectReason.PIPELINE_ERROR, detail))
