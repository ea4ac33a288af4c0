"""Connector configuration: parsed and validated once, at start-up, from `kv_connector_extra_config`."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping

RESERVATION_MODES = ("exact", "vllm")
ADMISSION_POLICIES = ("fair", "greedy")
EVICTION_POLICIES = ("lru",)
DEFERRAL_FALLBACKS = ("recompute",)
# Worker copy backends (offload_connector.kernels): "auto" calibrates on CUDA and uses the torch reference on CPU.
TRANSFER_BACKENDS = ("auto", "reference", "kernel", "batch", "per_page", "host")


class ConfigError(ValueError):
    """A `kv_connector_extra_config` value the connector cannot run with."""


@dataclass(frozen=True)
class OffloadConfig:
    # Host bytes for the CPU tier, per worker rank.
    cpu_bytes: int
    # "exact": our per-group ledger decides admission. "vllm": trust vLLM's own reservation (comparison only:
    # it stalls hybrid sliding-window models on vLLM 0.32/0.33).
    reservation: str = "exact"
    # "fair": while a load is deferred for room, requests that arrived after it are held back whenever taking
    # their blocks would leave it without that room, so a stream of newer requests cannot starve it. "greedy":
    # every request is admitted as soon as it fits, whoever waits longer.
    admission_policy: str = "fair"
    # Under "fair", a deferred load starts holding newer requests back once it has waited this many steps. Holding
    # from the first step made short requests wait behind loads that had to wait for long decoders anyway
    # (decode-heavy replay, Gemma 4 31B: TTFT p95 14.9 s at 0, 13.3 s at 200, 10.4 s at 1,000); 0 holds at once.
    fair_hold_after_steps: int = 1000
    # Sliding-window and chunked-local blocks are stored for the windows a later request can resume from: the last
    # full block of every prompt, every boundary after it, prefixes found shared with an earlier request, and every
    # this-many tokens inside a prompt (rounded down to a multiple of every group's block size; 0: no checkpoints).
    window_checkpoint_tokens: int = 8192
    eviction: str = "lru"
    # A load that keeps being deferred for this many scheduler steps is given up and the prefix recomputed. Under
    # "fair" admission a deferred load waits only for requests already running or admitted, so this is a last resort;
    # under "greedy" it is what stops a stream of newer requests from starving it.
    max_deferral_steps: int = 10_000
    deferral_fallback: str = "recompute"
    # Loads shorter than this are not worth a transfer; the tokens are recomputed.
    min_load_tokens: int = 1
    # The stall watchdog fires after this many consecutive steps that schedule no token while requests wait and no
    # transfer is in flight: it logs the ledger and who holds the pool once, and raises a metric.
    stall_watchdog_steps: int = 100
    # A load not landed after this many seconds is reported failed (vLLM's kv_load_failure_policy decides between
    # recomputing and failing the request); 0 disables the deadline.
    load_timeout_s: float = 60.0
    # How the worker moves bytes; "auto" measures the candidates at start-up on a GPU.
    transfer_backend: str = "auto"
    # Fault injection for tests: overwrite the first block of every load after it lands, so that output
    # comparisons can be shown to fail. Never set this in production.
    debug_corrupt_load: bool = False
    # Fault injection for tests: report every load as failed without copying.
    debug_fail_load: bool = False
    # Test aid: report each landed load this many steps late, so that a CPU engine (whose copies finish within the
    # step) has loads in flight across steps, as a GPU engine does.
    debug_load_delay_steps: int = 0

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> "OffloadConfig":
        extra = dict(extra or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ConfigError(
                f"kv_connector_extra_config: unknown key(s) {unknown}; accepted keys are {sorted(known)}")
        if "cpu_bytes" not in extra:
            raise ConfigError("kv_connector_extra_config: 'cpu_bytes' is required (a positive integer: host bytes "
                              "for the CPU tier per worker, e.g. 64000000000 or \"64g\")")
        values = {
            "cpu_bytes": _positive_int("cpu_bytes", extra.pop("cpu_bytes"), allow_suffix=True),
        }
        if "reservation" in extra:
            values["reservation"] = _choice("reservation", extra.pop("reservation"), RESERVATION_MODES)
        if "admission_policy" in extra:
            values["admission_policy"] = _choice("admission_policy", extra.pop("admission_policy"),
                                                 ADMISSION_POLICIES)
        if "fair_hold_after_steps" in extra:
            value = extra.pop("fair_hold_after_steps")
            values["fair_hold_after_steps"] = 0 if value == 0 and not isinstance(value, bool) else \
                _positive_int("fair_hold_after_steps", value)
        if "window_checkpoint_tokens" in extra:
            value = extra.pop("window_checkpoint_tokens")
            values["window_checkpoint_tokens"] = 0 if value == 0 and not isinstance(value, bool) else \
                _positive_int("window_checkpoint_tokens", value)
        if "eviction" in extra:
            values["eviction"] = _choice("eviction", extra.pop("eviction"), EVICTION_POLICIES)
        if "deferral_fallback" in extra:
            values["deferral_fallback"] = _choice("deferral_fallback", extra.pop("deferral_fallback"),
                                                  DEFERRAL_FALLBACKS)
        if "max_deferral_steps" in extra:
            values["max_deferral_steps"] = _positive_int("max_deferral_steps", extra.pop("max_deferral_steps"))
        if "min_load_tokens" in extra:
            values["min_load_tokens"] = _positive_int("min_load_tokens", extra.pop("min_load_tokens"))
        if "stall_watchdog_steps" in extra:
            values["stall_watchdog_steps"] = _positive_int("stall_watchdog_steps", extra.pop("stall_watchdog_steps"))
        if "transfer_backend" in extra:
            values["transfer_backend"] = _choice("transfer_backend", extra.pop("transfer_backend"), TRANSFER_BACKENDS)
        if "load_timeout_s" in extra:
            values["load_timeout_s"] = _non_negative_float("load_timeout_s", extra.pop("load_timeout_s"))
        if "debug_load_delay_steps" in extra:
            value = extra.pop("debug_load_delay_steps")
            values["debug_load_delay_steps"] = 0 if value == 0 and not isinstance(value, bool) else \
                _positive_int("debug_load_delay_steps", value)
        if "debug_fail_load" in extra:
            values["debug_fail_load"] = _bool("debug_fail_load", extra.pop("debug_fail_load"))
        if "debug_corrupt_load" in extra:
            values["debug_corrupt_load"] = _bool("debug_corrupt_load", extra.pop("debug_corrupt_load"))
        return cls(**values)


_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def _positive_int(key: str, value: Any, allow_suffix: bool = False) -> int:
    parsed: int | None = None
    if isinstance(value, bool):
        parsed = None
    elif isinstance(value, int):
        parsed = value
    elif isinstance(value, float) and value.is_integer():
        parsed = int(value)
    elif isinstance(value, str) and allow_suffix:
        text = value.strip().lower().removesuffix("b")
        for suffix in sorted(_SUFFIXES, key=len, reverse=True):
            if text.endswith(suffix):
                try:
                    parsed = int(float(text[: -len(suffix)]) * _SUFFIXES[suffix])
                except ValueError:
                    parsed = None
                break
        else:
            parsed = int(text) if text.isdigit() else None
    if parsed is None or parsed <= 0:
        hint = ' (an integer, or a string such as "64g" or "512Mi")' if allow_suffix else " (an integer)"
        raise ConfigError(f"kv_connector_extra_config: '{key}' must be a positive integer{hint}; got {value!r}")
    return parsed


def _non_negative_float(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0 or value == float("inf"):
        raise ConfigError(f"kv_connector_extra_config: '{key}' must be a number of seconds >= 0 (0 disables it); "
                          f"got {value!r}")
    return float(value)


def _bool(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"kv_connector_extra_config: '{key}' must be true or false; got {value!r}")
    return value


def _choice(key: str, value: Any, accepted: tuple[str, ...]) -> str:
    if value not in accepted:
        raise ConfigError(
            f"kv_connector_extra_config: '{key}' must be one of {list(accepted)}; got {value!r}")
    return value
