"""Status's own small history of samples: ``<state>/status/samples.json``.

Each ``cdc status`` (and each sample ``cdc serve`` takes) appends one sample: the wall time, the
source's WAL position, and per stage its position and lag. The verdicts read the samples inside
the evaluation window to judge "rising" and "not moving", so a one-shot ``cdc status`` can judge
them too. Samples older than ``keep_s`` are dropped, and at most ``max_samples`` are kept. Written
atomically (temp + rename, 0600); concurrent writers may lose each other's newest sample, never
corrupt the file (a sample is a hint for the next judgement, not data).
"""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path
from typing import Any

import orjson

from cdc.cli.status.judge import Point

FILE = "samples.json"


def history_path(state_dir: Path) -> Path:
    return Path(state_dir) / "status" / FILE


def load(state_dir: Path) -> list[dict[str, Any]]:
    try:
        doc = orjson.loads(history_path(state_dir).read_bytes())
    except (FileNotFoundError, orjson.JSONDecodeError):
        return []
    return [s for s in doc if isinstance(s, dict) and "t_ms" in s] if isinstance(doc, list) else []


def append(
    state_dir: Path, sample: dict[str, Any], *, keep_s: float, max_samples: int = 500
) -> list[dict[str, Any]]:
    """Add ``sample`` and prune; returns the kept samples (oldest first)."""
    samples = [s for s in load(state_dir) if sample["t_ms"] - int(s["t_ms"]) <= keep_s * 1000]
    samples.append(sample)
    samples = samples[-max_samples:]
    path = history_path(state_dir)
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = path.with_name(f".{FILE}.{os.getpid()}.{threading.get_ident()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(orjson.dumps(samples))
        os.replace(tmp, path)
    except OSError:  # a read-only state dir: judge without keeping the sample
        with contextlib.suppress(OSError):
            tmp.unlink()
    return samples


def points(samples: list[dict[str, Any]], stage: str) -> list[Point]:
    """The stage's points from the samples (oldest first)."""
    out = []
    for s in samples:
        st = s.get("stages", {}).get(stage)
        if st is not None:
            out.append(Point(int(s["t_ms"]), st.get("position"), st.get("lag")))
    return out
