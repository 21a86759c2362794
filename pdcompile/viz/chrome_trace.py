"""Chrome trace of a timeline: one complete ("X") event per action, one thread per rank.

Opens in Perfetto (ui.perfetto.dev) and chrome://tracing. Times in microseconds, as the format
wants; thread names ("worker 3") come as metadata ("M") events.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pdcompile.schedule.ir import parse_action
from pdcompile.timeline import Timeline


def to_chrome_trace(timeline: Timeline) -> dict[str, Any]:
    """The trace as a dict: {"traceEvents": [...], "displayTimeUnit": "ms", "otherData": meta}."""
    t0 = timeline.start
    events: list[dict[str, Any]] = [
        {"name": "thread_name", "ph": "M", "pid": 0, "tid": rank,
         "args": {"name": f"worker {rank}"}}
        for rank in timeline.ranks
    ]
    for event in timeline.events:
        action = parse_action(event.action)
        args: dict[str, Any] = {"stage": action.stage, "microbatch": action.microbatch}
        if action.peer is not None:
            args["peer"] = action.peer
        events.append({"name": event.action, "cat": action.kind.value, "ph": "X", "pid": 0,
                       "tid": event.rank, "ts": (event.start - t0) * 1e6,
                       "dur": max(0.0, event.duration) * 1e6, "args": args})
    meta = {k: str(v) for k, v in timeline.meta.items()}
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"source": timeline.source, **meta}}


def write_chrome_trace(timeline: Timeline, path: str | Path) -> Path:
    """Write the trace JSON to `path`; returns the path."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(to_chrome_trace(timeline)))
    return target
