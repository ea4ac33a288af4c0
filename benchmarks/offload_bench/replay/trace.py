"""Mooncake-format traces: loading, validation, and the prompt tokens each request replays.

A trace is JSON Lines, one request per line: `timestamp` (ms since the trace start), `input_length`,
`output_length` and `hash_ids` (one id per 512-token block of the prompt, the last block possibly partial; equal
ids mean equal content, so a shared prefix is a shared run of leading ids). Other fields are kept as `extra` and
otherwise ignored, so any Mooncake-format file replays as it is. Gzip-compressed files are read transparently
(recognised by their header, whatever the name).

Whatever the file holds, loading it either returns records or raises one `TraceError` whose message is one line naming
the file, the line and (for a bad value) the field: binary or non-UTF-8 content, a file named .gz that is not gzip
(or is truncated or corrupt), other compression formats, JSON nested too deeply, numbers too large to convert, an
empty file, lines longer than `MAX_LINE_BYTES`, more than `MAX_RECORDS` requests, and out-of-range values.

Prompt tokens are derived from the ids, not invented per request: block id h always expands to the same 512 token
ids (seeded), so two requests that share leading hash ids share a token prefix and vLLM's own block hasher sees the
same shared prefix the trace describes.

Optional session fields (an extension the built-in workloads use; plain Mooncake files have none): `session`
(string) and `turn` (integer >= 0). Turn k > 0 of a session continues turn k - 1: its prompt is that turn's prompt,
then the tokens the simulated model sampled for it (every sampled token is `SAMPLED_TOKEN`), then new tokens from
its own hash ids. That is a chat conversation: the next turn resumes at the end of the previous answer.
"""

from __future__ import annotations

import gzip
import json
import random
import reprlib
import zlib
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable, Sequence

MOONCAKE_BLOCK_TOKENS = 512
_VOCAB = (100, 30000)  # token ids drawn from [100, 30000): clear of special ids, inside every bundled vocabulary
REQUIRED_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")
SAMPLED_TOKEN = 7  # what sim.driver's simulated model samples for every output token

# Limits on what a trace may hold, so that no input can exhaust memory or time before the replay starts. A Mooncake
# line is a few KB (a 1M-token prompt is 2,048 hash ids, ~20 KB); the published traces hold 4k-24k requests.
MAX_LINE_BYTES = 4 * 2**20
MAX_RECORDS = 1_000_000
MAX_LINES = 10 * MAX_RECORDS  # blank lines included
MAX_TRACE_BYTES = 4 * 2**30  # decompressed
MAX_TOKENS = 2**31 - 1  # input_length / output_length
MAX_HASH_ID = 2**63 - 1
MAX_TIMESTAMP_MS = float(2**53)  # exactly representable; epoch milliseconds (1.7e12) fit
MAX_SPAN_MS = 1e11  # first to last arrival, about 3.2 years: simulated time stays precise to well under a step
_COMPRESSED = ((b"BZh", "bzip2"), (b"\xfd7zXZ\x00", "xz"), (b"(\xb5/\xfd", "zstd"), (b"PK\x03\x04", "zip"),
               (b"\x04\x22\x4d\x18", "lz4"))


class TraceError(ValueError):
    """A malformed trace; the message names the source, the line and the field."""


@dataclass(frozen=True)
class TraceRecord:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    line: int = 0  # 1-based line in the source (0: generated)
    session: str | None = None
    turn: int | None = None
    extra: tuple[tuple[str, Any], ...] = field(default=(), compare=False)

    def get(self, key: str, default: Any = None) -> Any:
        return dict(self.extra).get(key, default)


_SHOW = reprlib.Repr()
_SHOW.maxlevel, _SHOW.maxlist, _SHOW.maxdict, _SHOW.maxstring, _SHOW.maxother, _SHOW.maxlong = 2, 6, 4, 40, 40, 40


def _bad(source: str, line: int, fld: str, msg: str, value: Any) -> TraceError:
    shown = _SHOW.repr(value)  # bounded depth and length: a value can be nested 900 deep or hold 10^6 items
    if len(shown) > 80:
        shown = shown[:77] + "..."
    return TraceError(f"{source} line {line}: field '{fld}' {msg} (got {shown})")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def parse_record(obj: Any, source: str, line: int, block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> TraceRecord:
    """Validate one decoded JSON line."""
    if not isinstance(obj, dict):
        raise TraceError(f"{source} line {line}: expected a JSON object with fields {list(REQUIRED_FIELDS)}, "
                         f"got {type(obj).__name__}")
    for fld in REQUIRED_FIELDS:
        if fld not in obj:
            raise TraceError(f"{source} line {line}: missing field '{fld}' (required: {list(REQUIRED_FIELDS)})")
    ts = obj["timestamp"]
    if not isinstance(ts, (int, float)) or isinstance(ts, bool) or not 0 <= ts <= MAX_TIMESTAMP_MS:
        raise _bad(source, line, "timestamp", "must be a finite number of milliseconds in [0, 2^53]", ts)
    n_in, n_out = obj["input_length"], obj["output_length"]
    if not _is_int(n_in) or not 1 <= n_in <= MAX_TOKENS:
        raise _bad(source, line, "input_length", "must be an integer in [1, 2^31 - 1]", n_in)
    if not _is_int(n_out) or not 1 <= n_out <= MAX_TOKENS:
        raise _bad(source, line, "output_length", "must be an integer in [1, 2^31 - 1]", n_out)
    ids = obj["hash_ids"]
    if not isinstance(ids, list) or not all(_is_int(h) and 0 <= h <= MAX_HASH_ID for h in ids):
        raise _bad(source, line, "hash_ids", "must be a list of integers in [0, 2^63 - 1]", ids)
    need = -(-n_in // block_tokens)
    if len(ids) != need:
        raise _bad(source, line, "hash_ids",
                   f"must hold one id per {block_tokens}-token block of input_length {n_in}, i.e. {need} ids, "
                   f"not {len(ids)}", ids)
    session, turn = obj.get("session"), obj.get("turn")
    if (session is None) != (turn is None):
        raise TraceError(f"{source} line {line}: fields 'session' and 'turn' go together (got only "
                         f"{'session' if turn is None else 'turn'})")
    if session is not None and not isinstance(session, str):
        raise _bad(source, line, "session", "must be a string", session)
    if turn is not None and (not _is_int(turn) or not 0 <= turn <= MAX_TOKENS):
        raise _bad(source, line, "turn", "must be an integer in [0, 2^31 - 1]", turn)
    extra = tuple(sorted((k, v) for k, v in obj.items() if k not in REQUIRED_FIELDS + ("session", "turn")))
    return TraceRecord(float(ts), n_in, n_out, tuple(ids), line, session, turn, extra)


def parse_lines(lines: Iterable[str], source: str = "<trace>",
                block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> list[TraceRecord]:
    """Records in arrival order (stable for equal timestamps). Blank lines are skipped."""
    records = []
    i = 0
    for i, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as err:
            raise TraceError(f"{source} line {i}: not valid JSON ({err.msg} at column {err.colno})") from None
        except RecursionError:
            raise TraceError(f"{source} line {i}: not valid JSON here (nested too deeply)") from None
        except ValueError as err:  # e.g. an integer of more than 4,300 digits
            raise TraceError(f"{source} line {i}: not valid JSON here ({err})") from None
        records.append(parse_record(obj, source, i, block_tokens))
        if len(records) > MAX_RECORDS:
            raise TraceError(f"{source} line {i}: more than {MAX_RECORDS:,} requests; split the trace")
    if not records:
        raise TraceError(f"{source} line {max(i, 1)}: no requests in {i:,} line(s) (expected JSON Lines with "
                         f"fields {list(REQUIRED_FIELDS)})")
    records.sort(key=lambda r: r.timestamp_ms)
    span = records[-1].timestamp_ms - records[0].timestamp_ms
    if span > MAX_SPAN_MS:
        raise TraceError(f"{source} line {records[-1].line}: field 'timestamp' is {span:.0f} ms after the first "
                         f"request's (line {records[0].line}); arrivals may span at most {MAX_SPAN_MS:.0e} ms")
    check_sessions(records, source)
    return records


def check_sessions(records: Sequence[TraceRecord], source: str = "<trace>") -> None:
    """Each turn k > 0 must follow turn k - 1 of its session and contain its whole context."""
    last: dict[str, TraceRecord] = {}
    for r in records:
        if r.session is None:
            continue
        prev = last.get(r.session)
        where = f"{source} line {r.line}" if r.line else f"{source} session {r.session!r} turn {r.turn}"
        if r.turn == 0:
            if prev is not None:
                raise TraceError(f"{where}: field 'turn' is 0 but session {r.session!r} already started")
        elif prev is None or prev.turn != r.turn - 1:
            raise TraceError(f"{where}: field 'turn' is {r.turn} but turn {r.turn - 1} of session "
                             f"{r.session!r} does not come before it")
        elif r.input_length < prev.input_length + prev.output_length:
            raise TraceError(f"{where}: field 'input_length' ({r.input_length}) is shorter than the previous "
                             f"turn's prompt plus output ({prev.input_length} + {prev.output_length})")
        last[r.session] = r


def load_trace(path: str | Path, block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> list[TraceRecord]:
    """A Mooncake-format JSONL file, plain or gzip-compressed (recognised by its header)."""
    p = Path(path)
    src = str(p)
    try:
        if p.is_dir():
            raise TraceError(f"{src}: is a directory, not a trace file")
        if not p.is_file():
            raise TraceError(f"{src}: no such trace file" if not p.exists() else
                             f"{src}: not a regular file (a device, pipe or socket cannot be replayed)")
        with open(p, "rb") as raw:
            head = raw.read(8)
    except OSError as err:
        raise TraceError(f"{src}: cannot read ({err.strerror or err})") from None
    gz = head.startswith(b"\x1f\x8b")
    if not gz:
        for magic, kind in _COMPRESSED:
            if head.startswith(magic):
                raise TraceError(f"{src} line 1: {kind}-compressed; only plain or gzip-compressed JSON Lines are "
                                 f"read (decompress it first)")
        if p.suffix == ".gz":
            raise TraceError(f"{src} line 1: named .gz but not gzip-compressed (no gzip header)")
    try:
        with (gzip.open(p, "rb") if gz else open(p, "rb")) as fh:
            return parse_lines(_text_lines(fh, src, gz), src, block_tokens)
    except OSError as err:  # opening: the checks above passed, so this is rare (a file removed meanwhile)
        raise TraceError(f"{src}: cannot read ({err.strerror or err})") from None


def _text_lines(fh: Any, source: str, gz: bool) -> Iterable[str]:
    """Lines of a binary stream as text, each bounded in length, UTF-8 checked, read errors naming the line."""
    n = total = 0
    while True:
        try:
            raw = fh.readline(MAX_LINE_BYTES + 1)
        except (OSError, EOFError, zlib.error) as err:
            what = "gzip data is corrupt or truncated" if gz else "read error"
            raise TraceError(f"{source} line {n + 1}: {what} ({err})") from None
        if not raw:
            return
        n += 1
        total += len(raw)
        if len(raw) > MAX_LINE_BYTES:
            raise TraceError(f"{source} line {n}: longer than {MAX_LINE_BYTES:,} bytes (not JSON Lines: a binary "
                             f"file?)")
        if n > MAX_LINES or total > MAX_TRACE_BYTES:
            raise TraceError(f"{source} line {n}: more than {MAX_LINES:,} lines or {MAX_TRACE_BYTES:,} bytes")
        try:
            text = raw.decode("utf-8-sig" if n == 1 else "utf-8")
        except UnicodeDecodeError as err:
            raise TraceError(f"{source} line {n}: not UTF-8 text (byte 0x{raw[err.start]:02x} at column "
                             f"{err.start + 1}: a binary or compressed file?)") from None
        yield text


@lru_cache(maxsize=65536)
def block_tokens(hash_id: int, seed: int, n: int = MOONCAKE_BLOCK_TOKENS) -> tuple[int, ...]:
    """The token ids trace block `hash_id` stands for; deterministic in (seed, hash_id)."""
    rng = random.Random((seed << 40) ^ (hash_id * 0x9E3779B1) ^ 0x5EED)
    lo, hi = _VOCAB
    return tuple(rng.randrange(lo, hi) for _ in range(n))


def prompt_tokens(hash_ids: Sequence[int], input_length: int, seed: int,
                  block: int = MOONCAKE_BLOCK_TOKENS, context: Sequence[int] = ()) -> list[int]:
    """`context` (a previous turn's prompt and answer) first, then the hash blocks' tokens at their positions."""
    out = list(context[:input_length])
    while len(out) < input_length:
        j, off = divmod(len(out), block)
        take = min(block - off, input_length - len(out))
        out.extend(block_tokens(hash_ids[j], seed, block)[off:off + take])
    return out


class PromptBuilder:
    """Prompts for records in arrival order; keeps only the latest turn of each session for its successor."""

    def __init__(self, seed: int, block: int = MOONCAKE_BLOCK_TOKENS) -> None:
        self.seed = seed
        self.block = block
        self._ctx: dict[str, list[int]] = {}

    def build(self, rec: TraceRecord, input_length: int, output_length: int) -> list[int]:
        context: list[int] = []
        if rec.session is not None and rec.turn:
            context = self._ctx.pop(rec.session, [])
        toks = prompt_tokens(rec.hash_ids, input_length, self.seed, self.block, context)
        if rec.session is not None:
            self._ctx[rec.session] = toks + [SAMPLED_TOKEN] * output_length
        return toks


@dataclass(frozen=True)
class Clipped:
    record: TraceRecord
    input_length: int
    output_length: int
    clipped: bool


def clip_to_model(rec: TraceRecord, max_model_len: int, block: int = MOONCAKE_BLOCK_TOKENS) -> Clipped:
    """Fit a request into `max_model_len` by dropping its trailing input blocks (its shared prefix is kept).

    A trace written for a longer-context model would otherwise be rejected by vLLM; dropping the tail keeps the
    prefix structure, which is what the CPU tier is about. Clipped requests are counted in the results.
    """
    out = min(rec.output_length, max(1, max_model_len // 4))
    n_in = min(rec.input_length, max_model_len - out)
    return Clipped(rec, n_in, out, (n_in, out) != (rec.input_length, rec.output_length))
