"""PRMRunner: builds scorers from config, scores a ``TurnCache`` with per-scorer all-or-nothing commits,
and owns the scorers' lifecycle.

Scoring (``await run(cache, ctx, is_eval=, record_metrics=)``):
- every turn is token-backed (the cache guarantees it); scorers run in creation order, disabled ones skipped;
- a turn scorer runs over all turns concurrently; a trajectory scorer is called once with the turns
  parent-before-child; ``None``, an exception, a bad shape, a non-finite value or an unknown id raises
  ``PRMRejected`` (cancellation propagates untouched);
- result = scorer result x weight (scalar broadcast to ``[output_len]``), ADDED to existing token rewards;
  a scorer's results are committed to the cache only after all of them validated;
- structured observations: turn observations target their own interaction id, one per (scope, target,
  metric) and run, and the (value_type, aggregations) schema per (scorer, scope, metric) never changes;
- with ``advantage_shaping.mode == process_weighted`` the combined rewards must lie in [0, 1];
- metrics are recorded on ``self.metrics`` only when ``record_metrics`` (branch exporters pass False and
  publish once the whole session succeeded).

Lifecycle:
- ``PRMRunner(config)`` (sync, kept for compatibility): no rollback if a later scorer fails to build;
- ``await PRMRunner.create(config)``: if resolution, construction or validation fails, awaits cleanup of the
  owned scorers built so far (reverse order), then re-raises the ORIGINAL error with cleanup failures attached
  as notes; cancellation during that cleanup propagates;
- ``await aclose()``: rejects new ``run()`` calls at once, closes owned scorers (disabled ones too) in reverse
  creation order, each at most once; concurrent callers wait for the same cleanup; ordinary failures are
  logged and raised together as ``ExceptionGroup("PRM scorer cleanup failed", ...)`` after all were attempted
  (every later call re-raises that outcome); a cancelled hook counts as attempted and is never retried;
  borrowed scorers (instances passed in the config) are never closed.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import torch

from prm.cache import TurnCache
from prm.config import PRMConfig, PRMFileConfig, PRMScorerConfig, coerce_prm_config
from prm.errors import PRMConfigError, PRMRejected, PRMRunnerClosed
from prm.metrics import PRMMetrics, build_stats
from prm.scorer import BaseScorer, BaseTrajectoryScorer
from prm.types import Interaction, PRMScorerResult, PRMTurnResult, freeze
from prm.validation import check_observations, to_token_rewards

logger = logging.getLogger(__name__)


def _import_scorer_class(path: str) -> type[BaseScorer]:
    module_name, _, attr = path.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise PRMConfigError(f"cannot import PRM scorer module {module_name!r} (path {path!r}): {exc}") from exc
    cls = getattr(module, attr, None)
    if not isinstance(cls, type) or not issubclass(cls, BaseScorer):
        raise PRMConfigError(f"PRM scorer path {path!r} resolved to {cls!r}, not a BaseScorer subclass")
    return cls


def branch_messages(ordered: list[Interaction]) -> list[Any]:
    """The branch's full conversation: the last turn's context, its answer, and what followed it."""
    if not ordered:
        return []
    last = ordered[-1]
    answer = {"role": "assistant", **dict(last.response)}
    return [*last.messages, answer, *last.next_state]


class PRMRunner:
    """Runs configured scorers; see the module docstring for the scoring and lifecycle contract."""

    def __init__(self, config: PRMConfig | PRMFileConfig | Mapping[str, Any], *, metrics: PRMMetrics | None = None):
        self._init_state(config, metrics)
        self._build(self._entries)
        self._validate()

    def _init_state(self, config: Any, metrics: PRMMetrics | None) -> None:
        self.config = coerce_prm_config(config)
        self.metrics = metrics or PRMMetrics()
        self._entries: list[tuple[BaseScorer, bool]] = []  # (scorer, owned) in creation order
        self._schemas: dict[str, dict[tuple[str, str], tuple[str, tuple[str, ...]]]] = {}
        self._closing = False
        self._close_running: asyncio.Event | None = None
        self._close_attempted: set[int] = set()
        self._close_errors: list[Exception] = []

    @classmethod
    async def create(
        cls, config: PRMConfig | PRMFileConfig | Mapping[str, Any], *, metrics: PRMMetrics | None = None
    ) -> PRMRunner:
        """Async factory with startup rollback (see module docstring)."""
        self = cls.__new__(cls)
        self._init_state(config, metrics)
        try:
            self._build(self._entries)
            self._validate()
        except Exception as exc:
            owned = [s for s, is_owned in reversed(self._entries) if is_owned]
            for scorer in owned:
                try:
                    await scorer.aclose()
                except Exception as cleanup_exc:
                    logger.exception("PRM scorer %r cleanup after failed startup raised", scorer.name)
                    exc.add_note(f"cleanup of PRM scorer {scorer.name!r} failed: {cleanup_exc!r}")
            raise
        return self

    def _build(self, out: list[tuple[BaseScorer, bool]]) -> None:
        # Appends one by one so a failing constructor leaves the already-built ones visible for rollback.
        if not self.config.enabled:
            logger.warning("PRM scoring is disabled (prm.enabled=false)")
            return
        for spec in self.config.scorers:
            if isinstance(spec, BaseScorer):
                out.append((spec, False))
                continue
            assert isinstance(spec, PRMScorerConfig)
            scorer_cls = _import_scorer_class(spec.path)
            out.append((scorer_cls(weight=spec.weight, enabled=spec.enabled, **spec.kwargs), True))
        if not any(s.enabled for s, _ in out):
            logger.warning("PRMRunner has no active scorer; scoring is a no-op")

    def _validate(self) -> None:
        names: dict[str, str] = {}
        for scorer, _ in self._entries:
            if scorer.name in names:
                raise PRMConfigError(
                    f"two PRM scorers share the name {scorer.name!r} ({names[scorer.name]} and "
                    f"{type(scorer).__name__}); names are metric namespaces and must be unique"
                )
            names[scorer.name] = type(scorer).__name__
        for scorer, _ in self._entries:
            scorer.validate_prm_config(self.config, training_enabled=self.config.enabled and scorer.enabled)

    @property
    def scorers(self) -> tuple[BaseScorer, ...]:
        return tuple(s for s, _ in self._entries)

    @property
    def active(self) -> bool:
        return any(s.enabled for s, _ in self._entries)

    @property
    def closing(self) -> bool:
        return self._closing

    def owns(self, scorer: BaseScorer) -> bool:
        return any(s is scorer and owned for s, owned in self._entries)

    # ------------------------------------------------------------------ scoring

    async def run(
        self,
        cache: TurnCache,
        ctx: Mapping[str, Any] | None = None,
        *,
        is_eval: bool = False,
        record_metrics: bool = True,
    ) -> list[PRMTurnResult]:
        """Score every turn of ``cache`` and commit token rewards; returns the committed turn results."""
        if self._closing:
            raise PRMRunnerClosed("PRMRunner is closing; no new scoring is admitted")
        if not self.active or not len(cache):
            return []
        ordered = cache.ordered()
        items = cache.items()
        base_ctx = dict(ctx or {})
        base_ctx.setdefault("messages", branch_messages(ordered))
        base_ctx["is_eval"] = is_eval
        score_ctx = MappingProxyType({k: freeze(v) for k, v in base_ctx.items()})

        committed: list[PRMTurnResult] = []
        for scorer, _ in self._entries:
            if not scorer.enabled:
                continue
            results = await self._evaluate(scorer, cache, items, ordered, score_ctx)
            updates, turn_results, schemas = self._validate_results(scorer, cache, items, results)
            # All of this scorer's results validated: bind schemas, then commit.
            bound = self._schemas.setdefault(scorer.name, {})
            for key, schema in schemas.items():
                bound.setdefault(key, schema)
            for interaction_id, rewards in updates:
                cache.set_token_rewards(interaction_id, rewards)
            committed.extend(turn_results)

        if self.config.advantage_shaping.mode == "process_weighted":
            for interaction_id, _ in items:
                shaped = cache.token_rewards(interaction_id)
                if shaped is not None and bool(((shaped < 0) | (shaped > 1)).any()):
                    raise PRMRejected(
                        f"process_weighted shaping needs token rewards in [0, 1]; turn {interaction_id!r} has "
                        f"min {float(shaped.min()):.4g}, max {float(shaped.max()):.4g}"
                    )
        if record_metrics:
            self.metrics.record(build_stats(committed, [], is_eval=is_eval))
        return committed

    async def _evaluate(
        self,
        scorer: BaseScorer,
        cache: TurnCache,
        items: list[tuple[str, Interaction]],
        ordered: list[Interaction],
        ctx: Mapping[str, Any],
    ) -> list[PRMScorerResult]:
        name = scorer.name
        if isinstance(scorer, BaseTrajectoryScorer):
            try:
                by_id = await scorer.evaluate_trajectory(ordered, ctx)
            except Exception as exc:
                raise PRMRejected(f"trajectory scorer {name!r} raised: {exc!r}", scorer=name) from exc
            if by_id is None:
                raise PRMRejected(f"trajectory scorer {name!r} returned None", scorer=name)
            if not isinstance(by_id, Mapping):
                raise PRMRejected(
                    f"trajectory scorer {name!r} must return a mapping, got {type(by_id).__name__}", scorer=name
                )
            unknown = set(by_id) - {iid for iid, _ in items}
            if unknown:
                raise PRMRejected(
                    f"trajectory scorer {name!r} returned unknown interaction ids {sorted(map(str, unknown))}",
                    scorer=name,
                )
            scored = {iid: value for iid, value in by_id.items() if value is not None}
            if len(scored) < len(by_id):
                none_ids = sorted(iid for iid in by_id if iid not in scored)
                raise PRMRejected(f"trajectory scorer {name!r} returned None for {none_ids}", scorer=name)
            out = []
            for iid, interaction in items:
                raw = scored.get(iid, 0.0)  # an omitted id is an intentional zero
                try:
                    out.append(scorer.prepare_result(interaction, raw, ctx))
                except Exception as exc:
                    raise PRMRejected(
                        f"scorer {name!r} prepare_result raised on {iid!r}: {exc!r}", scorer=name
                    ) from exc
            return out

        async def one(interaction: Interaction) -> PRMScorerResult | BaseException | None:
            try:
                return await scorer.evaluate_result(interaction, ctx)
            except Exception as exc:  # noqa: BLE001 (user code; per turn, so one failure cannot hide the count)
                return exc

        raw_results = await asyncio.gather(*(one(it) for _, it in items))
        errors = [r for r in raw_results if isinstance(r, BaseException)]
        nones = sum(r is None for r in raw_results)
        if errors:
            raise PRMRejected(
                f"scorer {name!r} raised on {len(errors)}/{len(items)} turns: {errors[0]!r}", scorer=name
            ) from errors[0]
        if nones:
            raise PRMRejected(f"scorer {name!r} returned None for {nones}/{len(items)} turns", scorer=name)
        return raw_results  # type: ignore[return-value]

    def _validate_results(
        self,
        scorer: BaseScorer,
        cache: TurnCache,
        items: list[tuple[str, Interaction]],
        results: list[PRMScorerResult],
    ) -> tuple[list[tuple[str, torch.Tensor]], list[PRMTurnResult], dict]:
        name = scorer.name
        updates: list[tuple[str, torch.Tensor]] = []
        turn_results: list[PRMTurnResult] = []
        seen_keys: set[tuple[str, str, str]] = set()
        schemas: dict[tuple[str, str], tuple[str, tuple[str, ...]]] = {}
        for (iid, interaction), result in zip(items, results, strict=True):
            if not isinstance(result, PRMScorerResult):
                raise PRMRejected(
                    f"scorer {name!r} must produce PRMScorerResult, got {type(result).__name__} for {iid!r}",
                    scorer=name,
                )
            try:
                raw = to_token_rewards(result.reward, interaction.output_len)
                contribution = raw * scorer.weight
                if not bool(torch.isfinite(contribution).all()):
                    raise ValueError("weighted token rewards are not finite")
                observations = check_observations(
                    result.observations, iid, seen_keys, schemas, self._schemas.get(name, {})
                )
                existing = cache.token_rewards(iid)
                combined = contribution.clone() if existing is None else existing + contribution
                if not bool(torch.isfinite(combined).all()):
                    raise ValueError("combined token rewards are not finite")
            except (TypeError, ValueError) as exc:
                raise PRMRejected(f"scorer {name!r} result for {iid!r} is invalid: {exc}", scorer=name) from exc
            updates.append((iid, combined))
            turn_results.append(PRMTurnResult(name, iid, float(contribution.mean()), observations))
        return updates, turn_results, schemas

    # ---------------------------------------------------------------- lifecycle

    async def aclose(self) -> None:
        """Close owned scorers once (see module docstring); safe to call concurrently and repeatedly."""
        self._closing = True
        while self._close_running is not None:
            await self._close_running.wait()
        pending = [s for s, owned in reversed(self._entries) if owned and id(s) not in self._close_attempted]
        if pending:
            self._close_running = asyncio.Event()
            try:
                for scorer in pending:
                    self._close_attempted.add(id(scorer))  # before the await: interrupted hooks never rerun
                    try:
                        await scorer.aclose()
                    except Exception as exc:
                        logger.exception("PRM scorer %r aclose() failed", scorer.name)
                        self._close_errors.append(exc)
            finally:
                event, self._close_running = self._close_running, None
                event.set()
        if self._close_errors:
            raise ExceptionGroup("PRM scorer cleanup failed", list(self._close_errors))
