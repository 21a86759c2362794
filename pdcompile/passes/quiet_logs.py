"""torch's own reports on a failed torch.export attempt kept off stderr.

An attempt that fails on data-dependent Python (`if x.sum() > 0`) has torch print the whole
partial graph to stderr (torch.export's `_trace.py` prints `partial_fx_graph`) and log a
warning, once per attempt: dozens of lines of generated code before pdcompile's one-line
refusal, which already names the culprit and the fix. Within `torch_export_quiet()` torch's
tracing loggers report only CRITICAL records and stderr is held; what was written there is
passed on when the attempt succeeds (a model's own warnings) and dropped when it fails. The
loggers' levels and stderr are put back after it.
"""

from __future__ import annotations

import io
import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stderr

QUIETED = ("torch.fx.experimental.symbolic_shapes", "torch._subclasses.fake_tensor",
           "torch.export", "torch._export")


@contextmanager
def torch_export_quiet() -> Iterator[None]:
    """Within: torch's tracing loggers at CRITICAL, stderr held (passed on unless the block
    raises)."""
    loggers = [logging.getLogger(name) for name in QUIETED]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    held = io.StringIO()
    try:
        with redirect_stderr(held):
            yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)
    sys.stderr.write(held.getvalue())  # reached only when the attempt succeeded


__all__ = ["torch_export_quiet"]
