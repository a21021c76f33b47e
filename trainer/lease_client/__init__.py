"""The lease client: how any trainer (ours, verl, slime, a user's loop) takes judged samples from the policy server.

One package, importable alone (httpx, tenacity, pydantic; no torch, no server code) and used by the embedded
trainer too:

- :mod:`.client`: ``PolicyClient`` (lease with min/max/wait, ack, weight updates, retries within a deadline),
  ``FileSampleSource`` (a JSONL file with the same semantics), ``collect_leases`` (one step's leases, held
  within half the lease timeout so none expires before its ack) and the error tree;
- :mod:`.samples`: leased JSON as typed :class:`engine.records.Sample` records, the ``iter_batches``
  lease -> step -> ack iterator, and the weight-version / staleness fields.

It imports nothing of the trainer around it: a Sample as tensors, which needs torch and the trainer's own checks,
is :mod:`trainer.sample_tensors`.
"""

from trainer.lease_client.client import (
    FileSampleSource,
    Lease,
    Lineage,
    PolicyClient,
    PolicyRejected,
    PolicyUnavailable,
    PublishDeferred,
    SampleSource,
    SourceExhausted,
    TrainerError,
    WeightsRolledBack,
    collect_leases,
)
from trainer.lease_client.samples import (
    LeasedBatch,
    SetAside,
    iter_batches,
    leased_batch,
    oldest_version,
    staleness,
    typed_samples,
    version_number,
)

__all__ = [
    "FileSampleSource",
    "Lease",
    "LeasedBatch",
    "Lineage",
    "PolicyClient",
    "PolicyRejected",
    "PolicyUnavailable",
    "PublishDeferred",
    "SampleSource",
    "SetAside",
    "SourceExhausted",
    "TrainerError",
    "WeightsRolledBack",
    "collect_leases",
    "iter_batches",
    "leased_batch",
    "oldest_version",
    "staleness",
    "typed_samples",
    "version_number",
]
