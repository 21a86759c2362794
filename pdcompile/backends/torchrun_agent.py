"""torchrun as `pdcompile run` starts it: the same agent, with its failure report as data.

    python -m pdcompile.backends.torchrun_agent TORCHRUN_ARGS...

runs `torch.distributed.run` with exactly those arguments. The only differences: when workers
fail, the agent's report (a Python traceback and a table) becomes one JSON line in the file
named by REPORT_ENV, from which the launcher writes its one-line error; and the agent's own log
lines (process start and stop notices, its failure log) are left out.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

REPORT_ENV = "PDCOMPILE_TORCHRUN_REPORT"


def main(argv: list[str] | None = None) -> int:
    """Run the agent; 0 when every worker succeeded, 1 (report written) otherwise."""
    os.environ.setdefault("LOGLEVEL", "ERROR")  # read by torch.distributed.elastic's loggers
    # (by those made from now on; the ones torch made when it was imported are set below)
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    for name in list(logging.root.manager.loggerDict):  # created when torch was imported
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.CRITICAL)  # failures: our one line
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        run(args)
    except SignalException as err:  # the agent stopped its workers first
        return 128 + int(err.sigval)
    except ChildFailedError as err:
        failures = [{"rank": int(rank), "exitcode": f.exitcode, "pid": f.pid,
                     "signal": f.signal_name() if f.exitcode < 0 else None,
                     "time": f.timestamp}
                    for rank, f in sorted(err.failures.items())]
        report = os.environ.get(REPORT_ENV)
        if report:
            Path(report).write_text(json.dumps(failures))
        else:
            print(f"torchrun: workers failed: {json.dumps(failures)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
