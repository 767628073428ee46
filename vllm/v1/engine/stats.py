# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""``EngineStats``: what an engine run measured, for tests, benchmarks and the CLI.

Token accounting: each time a request is placed (scheduled fresh, or again after a preemption),
its ``num_tokens`` known tokens count as placed. Each placed token is either served (from the GPU
prefix cache, the CPU tier, or a secondary tier through a promotion) or computed by the prefill::

    prompt_tokens == tokens_from_gpu_cache + tokens_from_cpu + tokens_from_secondary
                     + prompt_tokens_computed

Tokens whose load failed (or did not verify) are recomputed, so they count as computed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.v1.kv_offload.base import OffloadKey

SECONDARY = "secondary"
"""Key of ``EngineStats.tokens_from_tier`` for promoted tokens whose tier the manager did not
name."""


@dataclass
class StepRecord:
    """One engine step.

    Attributes:
        step: the step's index (from 0).
        end_time: ``time.monotonic()`` at the end of the step.
        num_scheduled_tokens: tokens the model computed.
        num_running: requests running after the step.
        num_waiting: requests waiting after the step.
        connector_seconds: wall time in the scheduler-side connector's hooks (manager calls
            included) and in the collection of its statistics.
        connector_cpu_seconds: of it, the engine thread's CPU time (``time.thread_time``).
        worker_connector_seconds: wall time in the worker-side connector's hooks, summed over
            ranks.
        worker_connector_cpu_seconds: of it, the worker threads' CPU time, summed over ranks.
        bytes_moved: bytes of the transfers finished this step, per ``"SRC_to_DST"``.
    """

    step: int
    end_time: float
    num_scheduled_tokens: int
    num_running: int
    num_waiting: int
    connector_seconds: float
    connector_cpu_seconds: float
    worker_connector_seconds: float
    worker_connector_cpu_seconds: float
    bytes_moved: dict[str, int] = field(default_factory=dict)


TTFT_PARTS = ("slot", "lookup", "loading", "prefill")
"""The parts of a request's time to first token, in the order of ``EngineStats.ttft_parts``:

- ``slot``: from its arrival until the scheduler placed it (allocated its blocks), waiting for a
  place in the running batch or for free GPU blocks, minus ``lookup``;
- ``lookup``: from the first step the connector answered "not yet" for it (a tier's lookup still
  running, a block still being promoted into the CPU tier, or being loaded for another request)
  until the step it answered (0 when it never deferred it);
- ``loading``: from its placement until its connector load finished (0 without a load);
- ``prefill``: from then until its first token was sampled (chunked prefill over several steps,
  the steps it shared with other requests, and any preemption before its first token).
"""


@dataclass
class RequestTimes:
    """When a request passed each point before its first token (``time.monotonic()``), kept
    by the scheduler until that token: a few clock reads per request.

    Attributes:
        arrival: the request was created.
        deferred: the first time the connector answered "not yet" (None: never).
        answered: the first time it answered after ``deferred``.
        placed: its first placement.
        loaded: its connector load finished (None: no load).
    """

    arrival: float
    deferred: float | None = None
    answered: float | None = None
    placed: float | None = None
    loaded: float | None = None

    def parts(self, first_token: float) -> tuple[float, float, float, float]:
        """The ``TTFT_PARTS`` in seconds, for a first token sampled at ``first_token``; they
        add up to ``first_token - arrival``."""
        placed = first_token if self.placed is None else self.placed
        lookup = 0.0
        if self.deferred is not None:
            lookup = (placed if self.answered is None else self.answered) - self.deferred
        loading = 0.0 if self.loaded is None else self.loaded - placed
        prefill = first_token - (placed if self.loaded is None else self.loaded)
        return (placed - self.arrival - lookup, lookup, loading, prefill)


@dataclass
class EngineStats:
    """Cumulative counters of an engine (see the module docstring for the token accounting).

    Attributes:
        steps: steps run; ``idle_steps`` of them computed no token (stepping for transfers).
        idle_wait_seconds: time the thread driving the engine slept between steps, waiting for
            work or, after an idle step, for a transfer or lookup to progress
            (``EngineCore.step_or_wait``'s and ``AsyncLLM``'s waits).
        requests_added, requests_finished, requests_aborted: request counts.
        preemptions: requests preempted for lack of GPU blocks.
        placements: times a request was placed (fresh or after a preemption).
        prompt_tokens: tokens placed.
        tokens_from_gpu_cache: placed tokens served by the GPU prefix cache.
        tokens_from_cpu: placed tokens loaded from the CPU tier.
        tokens_from_secondary: placed tokens loaded from the CPU tier after being promoted into it
            from a secondary tier for this request.
        tokens_from_tier: ``tokens_from_secondary`` split by the type name of the tier the
            blocks were promoted from (``SECONDARY`` when the manager did not name it).
        blocks_verified_by_tier: of ``blocks_loaded_verified``, GPU blocks of promoted offloaded
            blocks, by the tier they were promoted from.
        bytes_from_tier: bytes that successful loads read of keys promoted from a secondary
            tier, by the tier's type name (``SECONDARY`` when not named): what the tier served,
            to set against the bytes it promoted (``LoadResult.promoted_bytes``).
        served_not_stored_here: when the engine tracks block origins
            (``EngineConfig.record_block_origins``), promoted tokens served per (tier, key) of
            blocks this engine had not stored itself before loading them: KV computed elsewhere
            (another instance sharing the tier, or an earlier run). None when not tracked.
        tokens_load_failed: tokens whose load failed or did not verify (then recomputed).
        tokens_computed: tokens the model computed (prefill and decode).
        output_tokens: tokens sampled.
        load_jobs_finished, load_jobs_failed: connector loads reported by every worker.
        blocks_loaded_verified: GPU blocks a load wrote, checked by ``EngineCore.verify_kv``
            (their digests were taken when the load completed).
        blocks_verified: GPU blocks checked in total (loads, finished requests and, with
            ``VerifyMode.ALL``, computed blocks against a reference).
        verification_failures: checks whose bytes differed from the reference.
        blocks_recomputed_for_check: blocks whose reference the check had to recompute (no
            reference was given and this engine had not computed them itself).
        verify_seconds: time spent in ``verify_kv`` (outside the engine's steps).
        events_published: KV event batches published.
        connector_seconds, worker_connector_seconds: totals of the per-step figures of
            ``StepRecord``.
        step_records: one record per step (when enabled).
        ttft_parts: per request, in the order their first tokens were sampled, its time to
            first token in parts (``TTFT_PARTS``, seconds; measured on the engine thread, from
            the request's arrival at the engine).
    """

    steps: int = 0
    idle_steps: int = 0
    idle_wait_seconds: float = 0.0
    requests_added: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0
    preemptions: int = 0
    placements: int = 0
    prompt_tokens: int = 0
    tokens_from_gpu_cache: int = 0
    tokens_from_cpu: int = 0
    tokens_from_secondary: int = 0
    tokens_from_tier: dict[str, int] = field(default_factory=dict)
    blocks_verified_by_tier: dict[str, int] = field(default_factory=dict)
    bytes_from_tier: dict[str, int] = field(default_factory=dict)
    served_not_stored_here: dict[tuple[str, OffloadKey], int] | None = None
    tokens_load_failed: int = 0
    tokens_computed: int = 0
    output_tokens: int = 0
    load_jobs_finished: int = 0
    load_jobs_failed: int = 0
    blocks_loaded_verified: int = 0
    blocks_verified: int = 0
    verification_failures: int = 0
    blocks_recomputed_for_check: int = 0
    verify_seconds: float = 0.0
    events_published: int = 0
    connector_seconds: float = 0.0
    worker_connector_seconds: float = 0.0
    step_records: list[StepRecord] = field(default_factory=list)
    ttft_parts: list[tuple[float, float, float, float]] = field(default_factory=list)

    @property
    def prompt_tokens_computed(self) -> int:
        """Placed tokens the prefill computed (not served from any cache or tier)."""
        return (
            self.prompt_tokens
            - self.tokens_from_gpu_cache
            - self.tokens_from_cpu
            - self.tokens_from_secondary
        )
