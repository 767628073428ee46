# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""``GatedTier``: the example tier with its reports handed over when a test says so (and
``WatchedExampleTier``, the example tier showing each submitted job to a hook first).

The tiering manager's error tests and its state machine drive real components (a primary over a
real shared region, the in-memory example tier); this double only decides when the example
tier's job reports reach the manager, records what the manager gave it, and lets a test add the
reports a broken third-party tier would make.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

from typing_extensions import override

from vllm.v1.kv_offload.base import ReqContext
from vllm.v1.kv_offload.tiering.base import JobResult, TierJob
from vllm.v1.kv_offload.tiering.example.manager import ExampleSecondaryTierManager


class WatchedExampleTier(ExampleSecondaryTierManager):
    """The example tier, showing each job the manager submits to ``on_submit`` before running
    it."""

    def on_submit(self, job: TierJob) -> None:
        """Called with each submitted job, store or load, before the example tier runs it.

        Args:
            job: the job the manager submitted.
        """

    @override
    def submit_store(self, job: TierJob) -> None:
        self.on_submit(job)
        super().submit_store(job)

    @override
    def submit_load(self, job: TierJob) -> None:
        self.on_submit(job)
        super().submit_load(job)


class GatedTier(WatchedExampleTier):
    """The example tier, reporting only while ``deliver`` is set (and, with
    ``deliver_on_drain``, once after each ``drain_jobs``).

    Attributes:
        deliver: hand the finished jobs over when the manager polls.
        extra: bad reports added to the next delivery (a broken tier's).
        submitted: every job the manager submitted, in order.
        reported: the ids of the jobs handed over.
        polls: how often the manager polled.
        finished_requests: the ``on_request_finished`` calls, by request id, in order.
    """

    def __init__(
        self, *args: Any, deliver: bool = True, deliver_on_drain: bool = False, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.deliver = deliver
        self._deliver_on_drain = deliver_on_drain
        self._drained = False
        self.extra: list[JobResult] = []
        self.submitted: list[TierJob] = []
        self.reported: list[int] = []
        self.polls = 0
        self.finished_requests: list[str] = []

    @override
    def on_submit(self, job: TierJob) -> None:
        self.submitted.append(job)

    @override
    def get_finished_jobs(self) -> Iterable[JobResult]:
        self.polls += 1
        if not (self.deliver or self._drained):
            return []
        self._drained = False
        results = list(super().get_finished_jobs())
        self.reported += [result.job_id for result in results]
        extra, self.extra = self.extra, []
        return results + extra

    @override
    def drain_jobs(self) -> None:
        # Every job already finished in its submit call; only the delivery can be pending.
        self._drained = self._deliver_on_drain

    @override
    def on_request_finished(self, req_context: ReqContext) -> None:
        self.finished_requests.append(req_context.req_id)

    def finished_calls(self) -> Counter[str]:
        """``on_request_finished`` calls per request id."""
        return Counter(self.finished_requests)

    def unreported(self) -> set[int]:
        """The ids of the finished jobs not handed over yet."""
        return {result.job_id for result in self._finished}
