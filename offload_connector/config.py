"""Connector configuration: parsed and validated once, at start-up, from `kv_connector_extra_config`."""

from __future__ import annotations

import contextlib
import contextvars
import math
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from fractions import Fraction
from typing import TYPE_CHECKING, Any, Mapping

from offload_connector.backends import BACKEND_CHOICES
from offload_connector.disk.format import FILE_NAME as DISK_FILE_NAME
from offload_connector.errors import ConfigError
from offload_connector.policies import EVICTION_POLICIES as _POLICY_REGISTRY, check_policy_spec

if TYPE_CHECKING:
    from vllm.config import VllmConfig

RESERVATION_MODES = ("exact", "vllm")
ADMISSION_POLICIES = ("fair", "greedy")
LOAD_COMPLETIONS = ("ordered", "landed")
# Worker copy backends (offload_connector.kernels): "auto" calibrates on CUDA and uses the torch reference on CPU.
TRANSFER_BACKENDS = BACKEND_CHOICES
EVICTION_POLICIES = tuple(_POLICY_REGISTRY)  # or "module.path:ClassName" (offload_connector/policies.py)


@dataclass(frozen=True)
class DebugConfig:
    """The `debug` section: fault injection and test aids, wrapped around the worker's copies by worker/faults.py
    only when one of them is on. Never set in production."""

    # Overwrite the first block of every load right after its copy, so that output comparisons (and verify_loads)
    # can be shown to fail.
    corrupt_load: bool = False
    # Report every load as failed without copying.
    fail_load: bool = False
    # On some workers only: the worker ranks (pp_rank x tensor_parallel_size + tp_rank) that report every load /
    # every store as failed without copying; the other ranks copy normally.
    fail_load_ranks: tuple[int, ...] = ()
    fail_store_ranks: tuple[int, ...] = ()
    # Report each landed load this many steps late, so that a CPU engine (whose copies finish within the step) has
    # loads in flight across steps, as a GPU engine does.
    load_delay_steps: int = 0
    # Issue the copy of every load this many seconds after the load is submitted (it has not landed until then), so
    # a CPU engine can exercise load_timeout_s against a load that genuinely has not landed.
    copy_delay_s: float = 0.0

    @property
    def enabled(self) -> bool:
        return self != DebugConfig()


# The flat keys the `debug` section replaced, still accepted (with one warning) so that scripts keep working.
DEPRECATED_DEBUG_KEYS = {f"debug_{f.name}": f.name for f in fields(DebugConfig)}


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
    # Under "fair", a deferred load holds newer requests back while the blocks they hold are what it waits for, and
    # every newer request once it has waited this many steps (0: at once). Holding everyone from the first step made
    # short requests wait behind loads that had to wait for long decoders anyway (decode-heavy replay, Gemma 4 31B:
    # TTFT p95 14.9 s at 0, 13.3 s at 200, 10.4 s at 1,000).
    fair_hold_after_steps: int = 1000
    # Sliding-window and chunked-local blocks are stored for the windows a later request can resume from: the last
    # full block of every prompt, every boundary after it, prefixes found shared with an earlier request, and every
    # this-many tokens inside a prompt (rounded down to a multiple of every group's block size; 0: no checkpoints).
    # None ("auto"): derived from the layout (`scheduler.windows.checkpoint_spacing`): a checkpoint's windows take at
    # most the CPU-tier slots of the full-attention KV between two checkpoints.
    window_checkpoint_tokens: int | None = None
    # Every other window too, as spare entries: they take only CPU-tier room nobody else uses (a free slot or another
    # spare entry's) and are evicted before anything else, so a tier with room resumes a prefix at any block boundary
    # while a full one holds what it held without them (scheduler/tier_index.py).
    spare_windows: bool = True
    # Which idle CPU-tier entry a store evicts (scheduler/eviction/): "lru"; "slru" (segmented LRU: entries that
    # served a load go after every entry that never did, at most 30 % of the slots kept that way); "arc" (Adaptive
    # Replacement Cache: recency list, list of reused entries, ghost lists moving the target between them); or a
    # policy class named "module.path:ClassName", imported and checked at start-up. "slru" by default: against the
    # patched vLLM it is the only one at or under it in TTFT and recompute on every built-in workload (README).
    eviction: str = "slru"
    # A load that keeps being deferred for this many scheduler steps is given up and the prefix recomputed. Under
    # "fair" admission a deferred load waits only for requests already running or admitted, so this is a last resort;
    # under "greedy" it is what stops a stream of newer requests from starving it.
    max_deferral_steps: int = 10_000
    # Loads shorter than this are not worth a transfer; the tokens are recomputed.
    min_load_tokens: int = 1
    # The stall watchdog fires after this many consecutive steps that schedule no token while requests wait and no
    # transfer is in flight: it logs the ledger and who holds the pool once, and raises a metric.
    stall_watchdog_steps: int = 100
    # A load not landed after this many seconds is reported failed (vLLM's kv_load_failure_policy decides between
    # recomputing and failing the request); 0 disables the deadline.
    load_timeout_s: float = 60.0
    # When the worker reports a load to vLLM as finished. "landed": once its bytes are on the GPU. "ordered": once its
    # copy is issued and should land before the forward that reads it (worker/landing.py); the scheduler then names the
    # load in the metadata of the first step whose forward pass may read its blocks, and the worker orders that forward
    # (and every later copy) after the copy on the device (stream order on CUDA, a host wait elsewhere). Under async
    # scheduling that runs a loaded request up to a step sooner; the GPU waits only if that forward would start before
    # the copy lands. With verify_loads every load is reported once landed, since its checksums can still fail it after
    # the copy.
    load_completion: str = "ordered"
    # How the worker moves bytes; "auto" measures the candidates at start-up on a GPU.
    transfer_backend: str = "auto"
    # Check every load against checksums taken when its blocks were stored (per host slot, over every page of the
    # block, computed where the KV cache lives: on CUDA only the 8-byte sums cross to the host). A mismatch fails the
    # load like a late one (failed_recving; kv_load_failure_policy decides), counted in load_verify_failures_total.
    verify_loads: bool = False
    # The disk tier (off unless both are set): a local directory and its byte budget per worker. Every block that
    # lands in the CPU tier is also written there in the background (write-through, so evicting a block from the
    # CPU tier never waits for I/O), a lookup extends into it, and a hit is read back into the CPU tier before its
    # load. Each worker keeps one preallocated file in its own subdirectory, fingerprinted with the model and KV
    # layout, so a restarted engine serves what it stored before and a different model never reads it.
    disk_path: str | None = None
    disk_bytes: int = 0
    # Who may write the disk tier: a file holding a secret (at least 16 bytes; never inline). Every slot is tagged
    # with an HMAC-SHA256 keyed by it (fingerprint, key, length and bytes) and a slot whose tag does not verify is a
    # miss, so a block planted in the directory is never served. Without it the tier trusts whoever can write the
    # directory (created owner-only) and checks CRC-32s. Set it when the directory is shared or on network storage.
    disk_secret_file: str | None = None
    # The shared tier (off unless set): a store several engines share, "redis" or "mooncake", and its options (a
    # JSON object: e.g. {"url": "redis://host:6379/0"} or {"master_server_address": "host:50051"}; see
    # offload_connector/remote). Like the disk tier it is written through and read back into the CPU tier; a block is
    # served only once every worker of the engine that wrote it has written its shard.
    remote_store: str | None = None
    remote_options: tuple[tuple[str, object], ...] = ()
    # Who may write the shared tier: a file holding a secret (at least 16 bytes, the same file on every engine that
    # shares the store; never inline, since vLLM logs its configuration). Every value is tagged with an HMAC-SHA256
    # keyed by it and a value whose tag does not verify is a miss. A shared tier needs one, unless the operator says
    # with remote_allow_unauthenticated that every writer of the store is trusted (CRC-32 checks only).
    remote_secret_file: str | None = None
    remote_allow_unauthenticated: bool = False
    # Fault injection and test aids (`"debug": {...}`, worker/faults.py): all off unless named. Never in production.
    debug: DebugConfig = field(default_factory=DebugConfig)

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, object] | None) -> "OffloadConfig":
        extra = dict(extra or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known - set(DEPRECATED_DEBUG_KEYS))
        if unknown:
            raise ConfigError(
                f"kv_connector_extra_config: unknown key(s) {unknown}; accepted keys are {sorted(known)}")
        if "cpu_bytes" not in extra:
            raise ConfigError("kv_connector_extra_config: 'cpu_bytes' is required (a positive integer: host bytes "
                              "for the CPU tier per worker, e.g. 64000000000 or \"64g\")")
        values = {
            "cpu_bytes": parse_byte_size("cpu_bytes", extra.pop("cpu_bytes")),
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
            if isinstance(value, str) and value == "auto" or value is None:
                values["window_checkpoint_tokens"] = None
            elif value == 0 and not isinstance(value, bool):
                values["window_checkpoint_tokens"] = 0
            else:
                try:
                    values["window_checkpoint_tokens"] = _positive_int("window_checkpoint_tokens", value)
                except ConfigError:
                    raise ConfigError(f"kv_connector_extra_config: 'window_checkpoint_tokens' must be a positive "
                                      f"integer, 0 (no checkpoints) or \"auto\" (derived from the layout); got "
                                      f"{value!r}") from None
        if "eviction" in extra:
            try:
                values["eviction"] = check_policy_spec(extra.pop("eviction"))
            except ValueError as exc:
                raise ConfigError(f"kv_connector_extra_config: 'eviction' {exc}") from None
        if "max_deferral_steps" in extra:
            values["max_deferral_steps"] = _positive_int("max_deferral_steps", extra.pop("max_deferral_steps"))
        if "min_load_tokens" in extra:
            values["min_load_tokens"] = _positive_int("min_load_tokens", extra.pop("min_load_tokens"))
        if "stall_watchdog_steps" in extra:
            values["stall_watchdog_steps"] = _positive_int("stall_watchdog_steps", extra.pop("stall_watchdog_steps"))
        if "transfer_backend" in extra:
            values["transfer_backend"] = _choice("transfer_backend", extra.pop("transfer_backend"), TRANSFER_BACKENDS)
        if "load_completion" in extra:
            values["load_completion"] = _choice("load_completion", extra.pop("load_completion"), LOAD_COMPLETIONS)
        if "load_timeout_s" in extra:
            values["load_timeout_s"] = _non_negative_float("load_timeout_s", extra.pop("load_timeout_s"))
        if "spare_windows" in extra:
            values["spare_windows"] = _bool("spare_windows", extra.pop("spare_windows"))
        if "verify_loads" in extra:
            values["verify_loads"] = _bool("verify_loads", extra.pop("verify_loads"))
        values["debug"] = _debug_section(extra)
        if "disk_path" in extra:
            values["disk_path"] = _disk_path(extra.pop("disk_path"))
        if "disk_bytes" in extra:
            values["disk_bytes"] = parse_byte_size("disk_bytes", extra.pop("disk_bytes"))
        if "remote_store" in extra:
            from offload_connector.remote import REMOTE_STORES
            kind = extra.pop("remote_store")
            values["remote_store"] = None if kind is None else _choice("remote_store", kind, tuple(sorted(REMOTE_STORES)))
        if "remote_options" in extra:
            values["remote_options"] = _remote_options(extra.pop("remote_options"))
        if values.get("remote_options") and values.get("remote_store") is None:
            raise ConfigError("kv_connector_extra_config: 'remote_options' needs 'remote_store' (one of "
                              "['mooncake', 'redis'])")
        for key in ("remote_secret_file", "disk_secret_file"):
            if key in extra:
                values[key] = _secret_file(key, extra.pop(key))
        if values.get("disk_secret_file") is not None and values.get("disk_path") is None:
            raise ConfigError("kv_connector_extra_config: 'disk_secret_file' needs the disk tier ('disk_path' and "
                              "'disk_bytes')")
        if "remote_allow_unauthenticated" in extra:
            values["remote_allow_unauthenticated"] = _bool("remote_allow_unauthenticated",
                                                           extra.pop("remote_allow_unauthenticated"))
        if values.get("remote_store") is not None:
            _check_remote(values["remote_store"], dict(values.get("remote_options", ())))
            _check_remote_auth(values.get("remote_secret_file"), values.get("remote_allow_unauthenticated", False))
        elif values.get("remote_secret_file") is not None or values.get("remote_allow_unauthenticated"):
            key = "remote_secret_file" if values.get("remote_secret_file") is not None \
                else "remote_allow_unauthenticated"
            raise ConfigError(f"kv_connector_extra_config: '{key}' needs 'remote_store' (one of "
                              f"['mooncake', 'redis'])")
        if (values.get("disk_path") is None) != (values.get("disk_bytes", 0) == 0):
            missing = "disk_bytes" if values.get("disk_path") is not None else "disk_path"
            raise ConfigError(f"kv_connector_extra_config: the disk tier needs both 'disk_path' and 'disk_bytes'; "
                              f"'{missing}' is missing")
        return cls(**values)


# Byte sizes mean what they mean in vLLM's own parser (vllm/utils/argparse_utils.py `human_readable_int`, used for
# `--kv-cache-memory-bytes`, `--max-num-batched-tokens`, `--max-model-len` and, in vLLM 0.33, for bare numbers inside
# JSON arguments such as `--kv-transfer-config`): a lower-case suffix is decimal, an upper-case one binary, so
# "64g" = 64 * 10**9 and "64G" = 64 * 2**30; decimals only with a decimal suffix ("1.5g"; vLLM refuses "1.5G").
# Added here, unambiguous and binary as in IEC: "Ki".."Ti" and "KiB".."TiB". Unlike vLLM, which truncates
# `float("4.35") * 1000` to 4349, a decimal must come out a whole number of bytes, computed exactly.
_DECIMAL_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY_SUFFIXES = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_SIZE_RE = re.compile(r"(?P<int>[0-9]+)(?:\.(?P<frac>[0-9]+))?(?:(?P<dec>[kmgt])|(?P<bin>[KMGT])(?P<iec>i|iB)?)?")
# The largest size an mmap length / off_t can carry; anything above is a typo, whatever the host.
MAX_BYTES = 2**63 - 1
_SIZE_HINT = ('a positive whole number of bytes: an integer, or a string such as "64g" (64*10^9) or "64G" / "64GiB" '
              '(64*2^30)')


def parse_byte_size(key: str, value: object) -> int:
    """A byte count from an integer, a whole float or a size string; one ConfigError naming `key` otherwise."""
    def bad(why: str) -> ConfigError:
        shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
        return ConfigError(f"kv_connector_extra_config: '{key}' must be {_SIZE_HINT}; got {shown} ({why})")

    if isinstance(value, bool):
        raise bad("a boolean")
    if isinstance(value, int):
        parsed = value
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise bad("not a finite number")
        if not value.is_integer():
            raise bad("not a whole number of bytes")
        parsed = int(value)
    elif isinstance(value, str):
        text = value.strip()
        if not text.isascii():
            raise bad("only ASCII digits and the suffixes k m g t K M G T Ki Mi Gi Ti (optionally iB) are accepted")
        m = _SIZE_RE.fullmatch(text)
        if m is None:
            if re.fullmatch(r"[0-9.]+ *[kKmMgGtT][bB]", text):  # "64GB": 10^9 or 2^30? vLLM has no such suffix
                num, unit = text[:-2].strip(), text[-2]
                raise bad(f'ambiguous suffix: write "{num}{unit.lower()}" (decimal) or "{num}{unit.upper()}iB" '
                          f'(binary)')
            raise bad("not a byte size")
        if len(m["int"].lstrip("0")) > 19:  # past 2^63 whatever the suffix (and clear of int()'s 4300-digit cap)
            raise bad("more than 2^63-1 bytes")
        number = Fraction(f"{m['int']}.{m['frac'] or 0}")
        if m["bin"] and m["frac"] is not None:
            raise bad(f"no decimals with a binary suffix, as in vLLM; did you mean "
                      f"\"{m['int']}.{m['frac']}{m['bin'].lower()}\"?")
        if m["frac"] is not None and not m["dec"]:
            raise bad("decimals only with a decimal suffix k m g t, as in vLLM")
        scaled = number * (_DECIMAL_SUFFIXES[m["dec"]] if m["dec"] else _BINARY_SUFFIXES[m["bin"]] if m["bin"] else 1)
        if scaled.denominator != 1:
            raise bad("not a whole number of bytes")
        parsed = int(scaled)
    else:
        raise bad("null" if value is None else f"a {type(value).__name__}")
    if parsed <= 0:
        raise bad("must be positive")
    if parsed > MAX_BYTES:
        raise bad("more than 2^63-1 bytes")
    return parsed


def _whole(value: object) -> int | None:
    """`value` as an integer when it is one (a whole float such as 3.0 too, as JSON may write it); None otherwise,
    booleans included."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def _positive_int(key: str, value: object, allow_suffix: bool = False) -> int:
    if allow_suffix:
        return parse_byte_size(key, value)
    parsed = _whole(value)
    if parsed is None or parsed <= 0:
        raise ConfigError(f"kv_connector_extra_config: '{key}' must be a positive integer (an integer); got {value!r}")
    return parsed


# ------------------------------------------------------------------------------------------- host memory
def host_available_bytes(meminfo: str = "/proc/meminfo", cgroup_root: str = "/sys/fs/cgroup"
                         ) -> tuple[int, str] | None:
    """Bytes this process can still take from the host, and where the figure comes from; None where unknown.

    MemAvailable (/proc/meminfo: free memory plus what the kernel can reclaim without swapping), lowered to the
    memory cgroup's headroom when a limit is set (cgroup v2 memory.max, v1 memory.limit_in_bytes: limit - usage +
    inactive file cache), since in a container /proc/meminfo shows the whole host.
    """
    found: list[tuple[int, str]] = []
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append((int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo"))
                    break
    except (OSError, ValueError, IndexError):
        pass
    for limit_f, usage_f, stat_key, sub in (("memory.max", "memory.current", "inactive_file", ""),
                                            ("memory.limit_in_bytes", "memory.usage_in_bytes",
                                             "total_inactive_file", "memory")):
        base = os.path.join(cgroup_root, sub)
        try:
            with open(os.path.join(base, limit_f)) as f:
                raw = f.read().strip()
            if raw == "max" or int(raw) >= 2**62:
                continue
            with open(os.path.join(base, usage_f)) as f:
                usage = int(f.read().strip())
            reclaimable = 0
            try:
                with open(os.path.join(base, "memory.stat")) as f:
                    for line in f:
                        name, _, val = line.partition(" ")
                        if name == stat_key:
                            reclaimable = int(val)
                            break
            except (OSError, ValueError):
                pass
            found.append((max(0, int(raw) - usage + reclaimable), f"the memory cgroup's headroom ({base}/{limit_f})"))
        except (OSError, ValueError):
            continue
    return min(found) if found else None


def local_worker_count(vllm_config: VllmConfig) -> int:
    """Workers of this engine that run on this host and each allocate `cpu_bytes`.

    vLLM starts one worker per rank of pipeline x tensor (x prefill-context) parallelism; `local_world_size` is the
    share on this node (the whole world on one host). Data-parallel engines started together on one host
    (`data_parallel_size_local`) each have as many; with the external launcher the world already counts them.
    """
    pc = getattr(vllm_config, "parallel_config", None)
    if pc is None:
        return 1
    try:
        n = int(getattr(pc, "local_world_size", None) or pc.world_size)
    except Exception:  # noqa: BLE001 - an inconsistent parallel config is vLLM's to report, not ours
        n = int(getattr(pc, "world_size", 1) or 1)
    if getattr(pc, "distributed_executor_backend", None) != "external_launcher":
        n *= max(1, int(getattr(pc, "data_parallel_size_local", 1) or 1))
    return max(1, n)


def check_host_memory(cpu_bytes: int, workers: int = 1, extra_host_bytes: int = 0, extra_what: str = "",
                      available: tuple[int, str] | None = None) -> None:
    """One ConfigError naming 'cpu_bytes' when `workers` host tiers (plus `extra_host_bytes`) cannot fit the host.

    Called before anything is allocated. Pinning (cudaHostRegister on CUDA) is not bounded by RLIMIT_MEMLOCK, which
    applies to mlock(), not to the NVIDIA driver's page locking, so RLIMIT_MEMLOCK is not checked; a registration
    the driver refuses falls back to pageable memory with a warning (kernels/host_tier.py).
    """
    if available is None:
        available = host_available_bytes()
    if available is None:
        return
    have, source = available
    need = cpu_bytes * workers + extra_host_bytes
    if need <= have:
        return
    asked = f"{cpu_bytes:,} bytes ({cpu_bytes / 2**30:.1f} GiB)"
    if workers != 1:
        asked += f" per worker x {workers} workers on this host"
    if extra_host_bytes:
        asked += f" + {extra_host_bytes:,} bytes {extra_what}".rstrip()
    if workers != 1 or extra_host_bytes:
        asked += f" = {need:,} bytes"
    raise ConfigError(f"kv_connector_extra_config: 'cpu_bytes' asks for {asked}, but only {have:,} bytes "
                      f"({have / 2**30:.1f} GiB) are available ({source}); lower 'cpu_bytes'")


def _non_negative_float(key: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0 or value == float("inf"):
        raise ConfigError(f"kv_connector_extra_config: '{key}' must be a number of seconds >= 0 (0 disables it); "
                          f"got {value!r}")
    return float(value)


def _disk_path(value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"kv_connector_extra_config: 'disk_path' must be a directory path (a non-empty string) or "
                          f"null; got {value!r}")
    if "\x00" in value:  # the OS refuses it later with a bare ValueError (a traceback at start-up)
        raise ConfigError(f"kv_connector_extra_config: 'disk_path' must not contain a NUL byte; got {value!r}")
    return os.path.abspath(os.path.expanduser(value))


def _secret_file(key: str, value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip() or "\x00" in value:
        raise ConfigError(f"kv_connector_extra_config: '{key}' must be the path of a file holding the tier's secret "
                          f"(a non-empty string without NUL bytes) or null; got {value!r}")
    path = os.path.abspath(os.path.expanduser(value))
    from offload_connector.tier_auth import read_secret
    read_secret(path, key)  # at the edge: a missing, unreadable or short file is one ConfigError now, not at first use
    return path


def _check_remote_auth(secret_file: str | None, allow_unauthenticated: bool) -> None:
    if secret_file is None and not allow_unauthenticated:
        raise ConfigError("kv_connector_extra_config: a shared tier ('remote_store') needs 'remote_secret_file' (a "
                          "file holding a secret of at least 16 bytes, the same on every engine sharing the store), "
                          "or 'remote_allow_unauthenticated': true to trust every writer of the store")
    if secret_file is not None and allow_unauthenticated:
        raise ConfigError("kv_connector_extra_config: 'remote_secret_file' and 'remote_allow_unauthenticated': true "
                          "exclude each other; give one")


def _remote_options(value: object) -> tuple[tuple[str, object], ...]:
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise ConfigError(f"kv_connector_extra_config: 'remote_options' must be a JSON object of the store's options; "
                          f"got {value!r}")
    if "client" in value or "fingerprint" in value:
        raise ConfigError("kv_connector_extra_config: 'remote_options' must not set 'client' or 'fingerprint' (the "
                          "connector builds them)")
    return tuple(sorted(value.items()))


def _check_remote(kind: str, options: Mapping[str, object]) -> None:
    """Option names checked at the edge (values when the store is opened, at start-up, with the same one line)."""
    import importlib

    from offload_connector.remote import REMOTE_STORES, RemoteConfigError
    module = importlib.import_module(f"offload_connector.remote.{REMOTE_STORES[kind][0]}")
    accepted = [o for o in module.OPTIONS if o != "client"]
    try:
        from offload_connector.remote.base import check_options
        check_options(kind, options, accepted)
        check_static = getattr(module, "check_static", None)  # values a backend can check without its server
        if check_static is not None:
            check_static(options)
    except RemoteConfigError as exc:
        raise ConfigError(f"kv_connector_extra_config: 'remote_options': {exc}") from None


def check_disk_dir(path: str, disk_bytes: int, workers: int = 1) -> None:
    """One ConfigError naming 'disk_path' / 'disk_bytes' when the directory cannot be created or written, or its
    filesystem cannot hold every local worker's file (new files only: a file already there is reused)."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"kv_connector_extra_config: 'disk_path' {path!r} cannot be created ({err.strerror})") \
            from None
    if not os.path.isdir(path) or not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"kv_connector_extra_config: 'disk_path' {path!r} is not a writable directory")
    existing = 0
    for root, _dirs, files in os.walk(path):
        existing += sum(os.path.getsize(os.path.join(root, f)) for f in files if f == DISK_FILE_NAME)
    need = disk_bytes * workers - existing
    free = os.statvfs(path)
    have = free.f_bavail * free.f_frsize
    if need > have:
        raise ConfigError(f"kv_connector_extra_config: 'disk_bytes' asks for {disk_bytes:,} bytes per worker x "
                          f"{workers} workers, but the filesystem of {path!r} has only {have:,} bytes free; lower "
                          f"'disk_bytes' or choose another 'disk_path'")


def _bool(key: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"kv_connector_extra_config: '{key}' must be true or false; got {value!r}")
    return value


def _ranks(key: str, value: object) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0
                                                       for r in value):
        raise ConfigError(f"kv_connector_extra_config: '{key}' must be a list of worker ranks (integers >= 0, "
                          f"pp_rank x tensor_parallel_size + tp_rank; e.g. [1]); got {value!r}")
    return tuple(sorted(set(value)))


def _debug_section(extra: dict[str, object]) -> DebugConfig:
    """Pops the `debug` section, and the flat `debug_*` keys it replaced, from `extra`: one DebugConfig."""
    section = extra.pop("debug", None)
    if section is None:
        section = {}
    elif not isinstance(section, Mapping) or not all(isinstance(k, str) for k in section):
        raise ConfigError(f"kv_connector_extra_config: 'debug' must be a JSON object of test aids (keys "
                          f"{_debug_keys()}); got {section!r}")
    unknown = sorted(f"debug.{k}" for k in set(section) - {f.name for f in fields(DebugConfig)})
    if unknown:
        raise ConfigError(f"kv_connector_extra_config: unknown key(s) {unknown}; accepted keys in 'debug' are "
                          f"{_debug_keys()}")
    # Named as written, so that an error points at the key in the operator's JSON.
    given = {name: (f"debug.{name}", value) for name, value in section.items()}
    aliases = sorted(k for k in DEPRECATED_DEBUG_KEYS if k in extra)
    for alias in aliases:
        name = DEPRECATED_DEBUG_KEYS[alias]
        if name in given:
            raise ConfigError(f"kv_connector_extra_config: '{alias}' (deprecated) and 'debug.{name}' are both "
                              f"given; keep 'debug.{name}'")
        given[name] = (alias, extra.pop(alias))
    if aliases:
        _warn_deprecated(aliases)
    values: dict[str, Any] = {}
    for name, (key, value) in given.items():
        if name in ("corrupt_load", "fail_load"):
            values[name] = _bool(key, value)
        elif name in ("fail_load_ranks", "fail_store_ranks"):
            values[name] = _ranks(key, value)
        elif name == "load_delay_steps":
            steps = _whole(value)
            if steps is None or steps < 0:
                raise ConfigError(f"kv_connector_extra_config: '{key}' must be an integer >= 0 (steps; 0 disables "
                                  f"it); got {value!r}")
            values[name] = steps
        else:
            values[name] = _non_negative_float(key, value)
    return DebugConfig(**values)


def _debug_keys() -> list[str]:
    return [f"debug.{f.name}" for f in fields(DebugConfig)]


_WARNED_ALIASES: set[tuple[str, ...]] = set()  # once per process: both sides of the connector parse the same keys


def _warn_deprecated(aliases: list[str]) -> None:
    if tuple(aliases) in _WARNED_ALIASES:
        return
    _WARNED_ALIASES.add(tuple(aliases))
    from offload_connector.log import get_logger
    section = ", ".join(f'"{DEPRECATED_DEBUG_KEYS[a]}": ...' for a in aliases)
    get_logger(__name__).warning("kv_connector_extra_config: %s deprecated; write them in the debug section: "
                                 '"debug": {%s}', f"{aliases} are" if len(aliases) > 1 else f"'{aliases[0]}' is",
                                 section)


# `value` is Any, not object: `value in accepted` proves it a str, but type checkers do not narrow on that.
def _choice(key: str, value: Any, accepted: tuple[str, ...]) -> str:
    if value not in accepted:
        raise ConfigError(
            f"kv_connector_extra_config: '{key}' must be one of {list(accepted)}; got {value!r}")
    return value


# ------------------------------------------------------------------------------------------- start-up
def check_recurrent_state(vllm_config: VllmConfig) -> None:
    """A model with Mamba/linear-attention state is offloaded only in vLLM's align mode (`groups.describe_groups`
    refuses the same layouts later, from the KV cache groups; here it is one line before any KV cache or connector
    exists). Speculative decoding is accepted: its state blocks are in the ledger, and states are stored only where
    a prefill forward wrote them (`Layout.state_behind_drafts`)."""
    mc = getattr(vllm_config, "model_config", None)
    if mc is None or not (getattr(mc, "is_hybrid", False) or getattr(mc, "is_attention_free", False)):
        return
    arch = ",".join(getattr(mc, "architectures", None) or ["the model"])
    if getattr(mc, "is_attention_free", False):
        raise ConfigError(f"offload_connector: {arch} keeps only Mamba/linear-attention state (no attention); the "
                          f"connector offloads such state only next to attention, in hybrid models")
    mode = getattr(getattr(vllm_config, "cache_config", None), "mamba_cache_mode", "none")
    if mode != "align":
        raise ConfigError(f"offload_connector: {arch} keeps Mamba/linear-attention state and vLLM runs it in "
                          f"mamba_cache_mode '{mode}'; the connector restores such state only in 'align' mode "
                          f"(start vLLM with --enable-prefix-caching)")


def check_at_startup(vllm_config: VllmConfig) -> OffloadConfig:
    """The whole start-up check on a VllmConfig: the keys (debug rank lists within the engine's worker ranks), then
    the host memory every local host tier needs.

    On vLLM's CPU backend the KV cache is host memory too and is not allocated yet when this runs: its size
    (`--kv-cache-memory-bytes`, which VLLM_CPU_KVCACHE_SPACE sets) is counted per worker as well.
    """
    cfg = OffloadConfig.from_extra_config(vllm_config.kv_transfer_config.kv_connector_extra_config)
    check_recurrent_state(vllm_config)
    pc = getattr(vllm_config, "parallel_config", None)
    ranks = int(getattr(pc, "tensor_parallel_size", 1)) * int(getattr(pc, "pipeline_parallel_size", 1))
    for key in ("fail_load_ranks", "fail_store_ranks"):
        named = getattr(cfg.debug, key)
        if any(r >= ranks for r in named):
            raise ConfigError(f"kv_connector_extra_config: 'debug.{key}' must name worker ranks 0..{ranks - 1} "
                              f"(tensor_parallel_size x pipeline_parallel_size = {ranks}); got {list(named)}")
    if not _HOST_CHECK.get():
        return cfg
    workers = local_worker_count(vllm_config)
    kv_bytes = 0
    device = getattr(getattr(vllm_config, "device_config", None), "device_type", None)
    if device == "cpu":
        kv_bytes = int(getattr(getattr(vllm_config, "cache_config", None), "kv_cache_memory_bytes", None) or 0)
    check_host_memory(cfg.cpu_bytes, workers, kv_bytes * workers,
                      "of KV cache (vLLM's CPU backend keeps it in host memory)")
    if cfg.disk_path is not None:
        check_disk_dir(cfg.disk_path, cfg.disk_bytes, workers)
    return cfg


# A simulation plans vLLM's KV cache through the same start-up path (the layout question above) for tiers it never
# allocates (a 40 GiB tier replayed on a 24 GB machine): only the host check is skipped, the keys are still checked.
_HOST_CHECK: contextvars.ContextVar[bool] = contextvars.ContextVar("offload_connector_host_check", default=True)


@contextlib.contextmanager
def simulated_host() -> Iterator[None]:
    """Within this block `check_at_startup` checks the keys only: the host tier is simulated, never allocated."""
    token = _HOST_CHECK.set(False)
    try:
        yield
    finally:
        _HOST_CHECK.reset(token)
