"""Leased samples as typed records: the one Sample model, set-aside reasons, and the weight-version fields.

Role: what a trainer that is not ours (verl, slime, a user's loop) needs between ``lease`` and its own
tensors, with no torch import: each leased JSON object becomes an :class:`engine.records.Sample`
(``typed_samples``) or, when it does not fit the schema, a :class:`SetAside` with the reason (it is still
acked with its lease, as our trainer trains such a sample with mask 0: nothing leased is lost or retried
forever); :func:`iter_batches` is the lease -> step -> ack iterator over a ``SampleSource``.

Weight versions: the embedded trainer pushes ``weight_version = str(step)``, so versions are decimal integers
in the usual deployment. :func:`staleness` is THE staleness rule, for every trainer: how many weight updates
happened since the OLDEST version that sampled any token of the reply (``weight_versions`` when a reply crossed
an update, else ``weight_version``). A version that is not an integer (the engine's initial ``default``, a
framework naming its own versions) is unknown, so the staleness is None, never 0; only a caller that knows
which number such a version stands for says so (``initial_version``: our trainer publishes every version
after the engine's initial weights, so for it they are version 0).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from pydantic import ValidationError

from engine.records import Sample, SampleJSON
from trainer.lease_client.client import Lease, SampleSource, SourceExhausted, collect_leases


@dataclass(frozen=True)
class SetAside:
    """A leased sample that no trainer may use: its id (None when it has none) and why."""

    sample_id: str | None
    reason: str


def typed_samples(raw: list[SampleJSON]) -> tuple[list[Sample], list[SetAside]]:
    """Each leased JSON object as a :class:`Sample`, or set aside with the schema error; order is kept."""
    ok: list[Sample] = []
    aside: list[SetAside] = []
    for obj in raw:
        sid = obj.get("sample_id") if isinstance(obj, dict) else None
        try:
            ok.append(Sample.model_validate(obj))
        except ValidationError as exc:
            err = exc.errors()[0]
            where = ".".join(str(p) for p in err["loc"]) or "sample"
            aside.append(
                SetAside(str(sid) if sid is not None else None, f"off the Sample schema: {where}: {err['msg']}")
            )
    return ok, aside


def version_number(version: str | None) -> int | None:
    """The integer a weight version names ("12" -> 12), None for a missing or non-integer version."""
    if version is None:
        return None
    text = str(version).strip()
    return int(text) if text.lstrip("-").isdigit() else None


def oldest_version(sample: Sample, *, initial_version: int | None = None) -> int | None:
    """The oldest weight version that sampled any token of the reply; a non-integer version counts as
    ``initial_version``, and makes the answer None (unknown) when that is None."""
    versions: list[str | None] = list(sample.weight_versions or []) or [sample.weight_version]
    numbers = [version_number(v) for v in versions]
    known = [initial_version if n is None else n for n in numbers]
    return None if any(n is None for n in known) else min(n for n in known if n is not None)


def staleness(sample: Sample, current_version: str | int, *, initial_version: int | None = None) -> int | None:
    """Weight updates between the oldest version behind ``sample`` and ``current_version`` (None: unknown).
    ``initial_version``: the number a non-integer sample version stands for, when the caller knows it."""
    now = version_number(str(current_version))
    then = oldest_version(sample, initial_version=initial_version)
    return None if now is None or then is None else now - then


@dataclass
class LeasedBatch:
    """The samples of one training step and the leases that hold them; ``ack`` after the step is durable."""

    source: SampleSource
    leases: list[Lease]
    samples: list[Sample] = field(default_factory=list)
    set_aside: list[SetAside] = field(default_factory=list)
    prm_metrics: dict[str, float] = field(default_factory=dict)

    @property
    def lease_ids(self) -> list[str]:
        return [lease.lease_id for lease in self.leases]

    def ack(self) -> None:
        """Acks every lease of the batch (the set-aside samples with them: they will never become usable)."""
        for lease in self.leases:
            self.source.ack(lease.lease_id)


def leased_batch(source: SampleSource, leases: list[Lease]) -> LeasedBatch:
    """The typed batch of ``leases`` (their PRM metric windows merged, later leases' keys winning)."""
    batch = LeasedBatch(source=source, leases=leases)
    for lease in leases:
        ok, aside = typed_samples(lease.samples)
        batch.samples.extend(ok)
        batch.set_aside.extend(aside)
        batch.prm_metrics.update(lease.prm_metrics)
    return batch


def iter_batches(
    source: SampleSource, batch_size: int, *, min_batch: int | None = None, wait_s: float = 30.0
) -> Iterator[LeasedBatch]:
    """Steps of typed samples from ``source``: each holds ``min_batch`` (default ``batch_size``) to
    ``batch_size`` samples, or fewer when ``wait_s`` ended first; a wait that brought nothing is skipped.
    The caller acks each batch (``LeasedBatch.ack``) once the step that used it is saved; a batch it never
    acks returns to the server's pool when its leases expire. Ends when a finite source runs dry."""
    floor = batch_size if min_batch is None else min_batch
    while True:
        try:
            leases = collect_leases(source, batch_size, max(1, floor), wait_s)
        except SourceExhausted:
            return
        if leases:
            yield leased_batch(source, leases)
