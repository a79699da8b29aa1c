"""Readers for request traces: Azure LLM inference (2023/2024) and BurstGPT (v1 and the layout
with `Session ID,Elapsed time`). A bad row is reported with file and line and skipped, never a crash;
a file that cannot be a trace at all (missing, no header, missing columns) raises TraceFormatError."""
from __future__ import annotations

import csv
import math
import re
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path

AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
BURSTGPT_COLUMNS = ("Timestamp", "Request tokens", "Response tokens")  # Model, Log Type, Session ID optional
TRACE_FORMATS = ("azure", "burstgpt")


class TraceFormatError(ValueError):
    """The file cannot be read as a trace of the given format."""


@dataclass(frozen=True)
class TraceRequest:
    """One request of a workload: when it arrives and how many tokens go in and come out."""

    arrival_s: float  # seconds since the first request of the (filtered) trace
    num_prompt_tokens: int
    num_output_tokens: int
    model: str = ""  # BurstGPT `Model` (ChatGPT, GPT-4); empty for Azure
    log_type: str = ""  # BurstGPT `Log Type` (Conversation log, API log)
    session_id: str = ""  # BurstGPT `Session ID` in the newer layout
    line: int = 0  # line in the source file, for messages


@dataclass(frozen=True)
class BadRow:
    """A row skipped while reading a trace, and why."""

    path: str
    line: int
    reason: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.reason}"


@dataclass(frozen=True)
class Trace:
    """The good rows of a trace file (sorted by arrival) and the rows that were skipped."""

    requests: tuple[TraceRequest, ...]
    bad_rows: tuple[BadRow, ...]
    path: str


@dataclass(frozen=True)
class TraceFilter:
    """Which rows of a trace to keep; None keeps everything."""

    model: str | None = None  # BurstGPT Model, case-insensitive
    log_type: str | None = None  # BurstGPT Log Type, case-insensitive substring ("api", "conversation")
    start_s: float | None = None  # keep rows at or after this many seconds from the trace's first row
    end_s: float | None = None  # keep rows before this many seconds from the trace's first row
    max_requests: int | None = None  # keep the first N remaining rows

    def __post_init__(self):
        if self.max_requests is not None and self.max_requests < 1:
            raise ValueError(f"max_requests must be >= 1, got {self.max_requests}")
        if self.start_s is not None and self.end_s is not None and self.end_s <= self.start_s:
            raise ValueError(f"time range end ({self.end_s}) must be after its start ({self.start_s})")


_FRACTION = re.compile(r"(\.\d{6})\d+")


def parse_azure_time(text: str) -> float:
    """'2023-11-16 18:15:46.6805900' (7 fractional digits, optional zone; none means UTC) -> POSIX seconds."""
    dt = datetime.fromisoformat(_FRACTION.sub(r"\1", text.strip()))  # Python < 3.11 takes at most 6 digits
    return (dt if dt.tzinfo else dt.replace(tzinfo=timezone.utc)).timestamp()


def _open_rows(path: Path, required: tuple[str, ...]):
    if not path.is_file():
        raise TraceFormatError(f"{path}: no such trace file")
    f = path.open(newline="", encoding="utf-8-sig")
    reader = csv.reader(f)
    header = next(reader, None)
    if header is None:
        f.close()
        raise TraceFormatError(f"{path}: empty file, expected a header with {', '.join(required)}")
    cols = {name.strip(): i for i, name in enumerate(header)}
    missing = [c for c in required if c not in cols]
    if missing:
        f.close()
        raise TraceFormatError(f"{path}:1: header lacks {', '.join(missing)} (found {', '.join(header)})")
    return f, reader, cols


def _count(value: str, name: str) -> int:
    try:
        v = float(value)  # BurstGPT dumps sometimes write counts as 12.0
    except ValueError:
        raise ValueError(f"{name} {value!r} is not a number") from None
    if not math.isfinite(v) or v != int(v) or v < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    return int(v)


def _read(path: Path, required: tuple[str, ...], parse_row) -> Trace:
    f, reader, cols = _open_rows(path, required)
    rows, bad = [], []
    with f:
        for fields in reader:
            line = reader.line_num
            if not fields or all(not x.strip() for x in fields):
                continue
            if len(fields) != len(cols):
                bad.append(BadRow(str(path), line, f"{len(fields)} fields, header has {len(cols)}"))
                continue
            try:
                req = parse_row(fields, cols, line)
            except (ValueError, OverflowError) as exc:
                bad.append(BadRow(str(path), line, str(exc)))
                continue
            if req.num_prompt_tokens < 1 or req.num_output_tokens < 1:
                reason = (f"{req.num_prompt_tokens} prompt / {req.num_output_tokens} output tokens "
                          "(a failed request in the trace?); at least 1 of each needed")
                bad.append(BadRow(str(path), line, reason))
                continue
            rows.append(req)
    rows.sort(key=lambda r: r.arrival_s)
    t0 = rows[0].arrival_s if rows else 0.0
    return Trace(tuple(replace(r, arrival_s=r.arrival_s - t0) for r in rows), tuple(bad), str(path))


def _azure_row(fields: list[str], cols: dict[str, int], line: int) -> TraceRequest:
    try:
        t = parse_azure_time(fields[cols["TIMESTAMP"]])
    except ValueError:
        raise ValueError(f"TIMESTAMP {fields[cols['TIMESTAMP']]!r} is not a date and time") from None
    return TraceRequest(t, _count(fields[cols["ContextTokens"]], "ContextTokens"),
                        _count(fields[cols["GeneratedTokens"]], "GeneratedTokens"), line=line)


def _burstgpt_row(fields: list[str], cols: dict[str, int], line: int) -> TraceRequest:
    try:
        t = float(fields[cols["Timestamp"]])
    except ValueError:
        raise ValueError(f"Timestamp {fields[cols['Timestamp']]!r} is not a number of seconds") from None
    if not math.isfinite(t) or t < 0:
        raise ValueError(f"Timestamp must be finite seconds >= 0, got {fields[cols['Timestamp']]!r}")

    def opt(name: str) -> str:
        return fields[cols[name]].strip() if name in cols else ""

    return TraceRequest(t, _count(fields[cols["Request tokens"]], "Request tokens"),
                        _count(fields[cols["Response tokens"]], "Response tokens"),
                        model=opt("Model"), log_type=opt("Log Type"), session_id=opt("Session ID"), line=line)


def read_azure(path: str | Path) -> Trace:
    """Azure LLM inference trace: TIMESTAMP (date and time), ContextTokens, GeneratedTokens."""
    return _read(Path(path), AZURE_COLUMNS, _azure_row)


def read_burstgpt(path: str | Path) -> Trace:
    """BurstGPT: Timestamp (s), Model, Request tokens, Response tokens, Total tokens, Log Type;
    the newer layout adds Session ID and Elapsed time after Timestamp."""
    return _read(Path(path), BURSTGPT_COLUMNS, _burstgpt_row)


def detect_format(path: str | Path) -> str:
    """'azure' when the header has Azure's TIMESTAMP column, else 'burstgpt'."""
    with Path(path).open(newline="", encoding="utf-8-sig") as f:
        header = next(csv.reader(f), [])
    return "azure" if "TIMESTAMP" in (h.strip() for h in header) else "burstgpt"


def read_trace(path: str | Path, trace_format: str) -> Trace:
    """Read a trace of format 'azure' or 'burstgpt'."""
    if trace_format == "azure":
        return read_azure(path)
    if trace_format == "burstgpt":
        return read_burstgpt(path)
    raise TraceFormatError(f"unknown trace format {trace_format!r}; choose from {', '.join(TRACE_FORMATS)}")


def apply_filter(requests: tuple[TraceRequest, ...], flt: TraceFilter) -> tuple[TraceRequest, ...]:
    """Keep the rows `flt` selects; arrivals are re-based so the first kept row arrives at 0 s."""
    kept = []
    for r in requests:
        if flt.model is not None and r.model.lower() != flt.model.lower():
            continue
        if flt.log_type is not None and flt.log_type.lower() not in r.log_type.lower():
            continue
        if flt.start_s is not None and r.arrival_s < flt.start_s:
            continue
        if flt.end_s is not None and r.arrival_s >= flt.end_s:
            continue
        kept.append(r)
        if flt.max_requests is not None and len(kept) == flt.max_requests:
            break
    t0 = kept[0].arrival_s if kept else 0.0
    return tuple(replace(r, arrival_s=r.arrival_s - t0) for r in kept)
