"""Simulated time: how long an engine step and a KV transfer take.

Step time is a deliberately simple roofline-style model, the same for every connector (so it cannot favour one):

    step = overhead + prefill_token * (prompt tokens in the batch) + decode_request * (requests decoding)

`overhead` stands for reading the weights once per forward, `prefill_token` for the compute of one prompt token,
`decode_request` for reading one decoding request's KV. A step that schedules nothing (the engine polls while
waiting for transfers) takes `idle_step`. The GPU runs batches back to back: batch k+1 starts when batch k ends,
with scheduling hidden behind execution as under async scheduling.

Transfers: a job of B bytes takes B / bandwidth seconds on its direction's copy stream (host->device for loads,
device->host for stores); jobs in one direction run one after another, starting when they are issued (the start of
the forward of the batch that carries them) or when the previous job ends. The worker reports a job finished at the end
of the first batch that ends after it, which is when vLLM's worker checks for finished transfers. Our connector's
worker, with load_completion "ordered", may report a load before that, once its copy is issued and it expects it to land
before the forward that reads it; the forward pass the scheduler then orders after it starts no earlier than the copy's
end (`delay_batch_until`), and a copy ordered after it starts no earlier either.
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

DEFAULT_BANDWIDTH_GBPS = 50.0


@dataclass(frozen=True)
class TimeModel:
    overhead_ms: float
    prefill_token_us: float
    decode_request_us: float
    idle_step_ms: float = 1.0
    bandwidth_gbps: float = DEFAULT_BANDWIDTH_GBPS  # GB/s (1e9 bytes) per direction
    basis: str = ""  # where the numbers come from, printed with the results

    def __post_init__(self) -> None:
        for name in ("overhead_ms", "prefill_token_us", "decode_request_us", "idle_step_ms", "bandwidth_gbps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"time model: {name} must be > 0 (got {getattr(self, name)!r})")

    def step_seconds(self, prefill_tokens: int, decode_requests: int) -> float:
        if prefill_tokens == 0 and decode_requests == 0:
            return self.idle_step_ms * 1e-3
        return (self.overhead_ms * 1e-3 + prefill_tokens * self.prefill_token_us * 1e-6
                + decode_requests * self.decode_request_us * 1e-6)

    def transfer_seconds(self, nbytes: int) -> float:
        return nbytes / (self.bandwidth_gbps * 1e9)

    def describe(self) -> dict[str, Any]:
        return asdict(self)


# Rough single-accelerator figures (H100/H200 class); every connector runs on the same numbers, and each can be
# overridden from the command line. Gemma 4 31B: ~62 GB of bf16 weights read per forward (~15 ms), ~62 GFLOP per
# prompt token at a few hundred dense TFLOP/s (~40 us). DeepSeek-V4-Flash: 13B active parameters in fp8.
MODEL_TIME_DEFAULTS: dict[str, TimeModel] = {
    "gemma-4-31b": TimeModel(15.0, 40.0, 50.0, basis="gemma-4-31b: 62 GB bf16 weights/forward, 62 GFLOP/token"),
    "deepseek-v4-flash": TimeModel(8.0, 20.0, 30.0, basis="deepseek-v4-flash: 13B active fp8, ~26 GFLOP/token"),
    # gpt-oss-20b, at Gemma's rates: ~13 GB of weights (mxfp4 experts, bf16 rest) read per forward (~3 ms, plus
    # launch overhead that weighs more on a small model); 3.6B active parameters, ~7 GFLOP per prompt token; a
    # decoding request reads about a third of Gemma's KV bytes per token (24 KiB against 80 KiB plus windows).
    "gpt-oss-20b": TimeModel(4.0, 5.0, 20.0, basis="gpt-oss-20b: 13 GB mxfp4/bf16 weights/forward, 7 GFLOP/token"),
}
GENERIC_TIME = TimeModel(15.0, 40.0, 50.0, basis="generic (Gemma-4-31B figures); override with --step-overhead-ms, "
                                                 "--prefill-token-us, --decode-request-us")


def time_model_for(model: str, **overrides: Any) -> TimeModel:
    base = MODEL_TIME_DEFAULTS.get(model, GENERIC_TIME)
    fields = {**asdict(base), **{k: v for k, v in overrides.items() if v is not None}}
    if any(v is not None for k, v in overrides.items() if k != "bandwidth_gbps"):
        fields["basis"] = base.basis + " (overridden)"
    return TimeModel(**fields)


class SimClock:
    """Simulated time of one engine. `begin_batch` is called once per scheduled batch, in order."""

    def __init__(self, model: TimeModel) -> None:
        self.model = model
        self.now = 0.0  # end of the last scheduled batch: the GPU is busy until then
        self.batch_start = 0.0
        self.batch_end = 0.0
        self._unapplied: deque[float] = deque()  # end times of batches whose output was not applied yet
        self._stream_free = {"load": 0.0, "store": 0.0}
        self.forward_wait_s = 0.0  # simulated seconds forward passes waited for loads they were ordered after

    def begin_batch(self, prefill_tokens: int, decode_requests: int) -> None:
        self.batch_start = self.now
        self.now += self.model.step_seconds(prefill_tokens, decode_requests)
        self.batch_end = self.now
        self._unapplied.append(self.batch_end)

    def peek_applied_batch_end(self) -> float:
        """End time of the oldest batch whose output is not applied yet (drivers apply batches in order)."""
        return self._unapplied[0] if self._unapplied else self.now

    def pop_applied_batch_end(self) -> float:
        return self._unapplied.popleft() if self._unapplied else self.now

    def advance_to(self, t: float) -> None:
        """Idle engine: jump to the next arrival."""
        if t > self.now:
            self.now = t
            self.batch_start = self.batch_end = t

    def delay_batch_until(self, t: float) -> None:
        """The current batch's forward cannot start before `t` (it is ordered after a copy landing then): it and
        its end move later, and so does every batch after it."""
        if t <= self.batch_start:
            return
        shift = t - self.batch_start
        self.batch_start = t
        self.now += shift
        self.batch_end = self.now
        if self._unapplied:
            self._unapplied[-1] = self.batch_end
        self.forward_wait_s += shift

    def schedule_transfer(self, direction: str, nbytes: int, not_before: float = 0.0) -> float:
        """When a job issued at the current batch's start (or at `not_before`, when it is ordered after an earlier
        copy) finishes on its direction's stream."""
        start = max(self.batch_start, self._stream_free[direction], not_before)
        self._stream_free[direction] = start + self.model.transfer_seconds(nbytes)
        return self._stream_free[direction]

    def transfers_busy_until(self) -> float:
        return max(self._stream_free.values())
