"""torchrun as `pdcompile run` starts it: the same agent, with its failure report as data.

    python -m pdcompile.backends.torchrun_agent TORCHRUN_ARGS...

runs `torch.distributed.run` with exactly those arguments. The only differences: when workers
fail, the agent's report (a Python traceback and a table) becomes one JSON line in the file
named by REPORT_ENV, from which the launcher writes its one-line error; the agent's own log
lines (process start and stop notices, its failure log) are left out; and on the node that hosts
the rendezvous (static rendezvous, node rank 0) the store listens on the --master-addr given
only (127.0.0.1 for a run on this machine), not on every address as torchrun's own would
(backends/listen.py).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from pdcompile.errors import PdcompileError

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
        hosted = _host_store(args)  # noqa: F841 - the store and its socket live while we run
    except PdcompileError as err:
        return _report([], error=str(err))
    try:
        run(args)
    except SignalException as err:  # the agent stopped its workers first
        return 128 + int(err.sigval)
    except ChildFailedError as err:
        failures = [{"rank": int(rank), "exitcode": f.exitcode, "pid": f.pid,
                     "signal": f.signal_name() if f.exitcode < 0 else None,
                     "time": f.timestamp}
                    for rank, f in sorted(err.failures.items())]
        return _report(failures)
    return 0


def _report(failures: list[dict[str, Any]], *, error: str | None = None) -> int:
    """Write the failure report (REPORT_ENV) or print it; the agent's exit status, 1."""
    report = os.environ.get(REPORT_ENV)
    data: Any = failures if error is None else {"error": error}
    if report:
        Path(report).write_text(json.dumps(data))
    else:
        print(f"torchrun: workers failed: {json.dumps(data)}", file=sys.stderr)
    return 1


def _host_store(args: Any) -> tuple[Any, Any] | None:
    """On the node that hosts a static rendezvous, its store, on a socket bound to exactly
    --master-addr; torchrun's own TCPStore (multi-tenant, same port) then shares it."""
    from pdcompile.backends.listen import open_store

    static = getattr(args, "rdzv_backend", "static") == "static" and not args.rdzv_endpoint
    if not static or getattr(args, "standalone", False) or args.master_port is None \
            or (args.node_rank or 0) != 0:
        return None
    return open_store(args.master_addr, int(args.master_port), multi_tenant=True,
                      timeout=float(getattr(args, "rdzv_timeout", 900) or 900))


if __name__ == "__main__":
    sys.exit(main())
