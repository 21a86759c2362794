"""`pdcompile run EXPORT_DIR --nproc N`: train an exported pipeline across processes (torchrun).

The command builds a `torchrun` command line whose worker is
`python -m pdcompile.worker EXPORT_DIR ...` (so the exported folder also runs
under a plain `torchrun` with the same arguments; --dry-run prints it) and runs it, through a thin
wrapper of torchrun's agent that reports failed workers as data: a failed run ends in one line
naming the rank that failed first. Killing `pdcompile run` (SIGINT, SIGTERM, even SIGKILL) stops
every worker within a second or two. Multi-node flags (`--nnodes`,
`--node-rank`, `--master-addr`, `--master-port`, `--rdzv-*`, `--max-restarts`) pass through.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from pdcompile.backends.run_report import default_run_dir
from pdcompile.errors import DistributedError, PdcompileError
from pdcompile.machine.local import free_port
from pdcompile.plan import Plan
from pdcompile.util.manifest import read_json_bytes
from pdcompile.worker import DEFAULT_STEPS, add_training_options, training_arguments

WORKER_MODULE = "pdcompile.worker"
AGENT_MODULE = "pdcompile.backends.torchrun_agent"  # torchrun, reporting failures as data


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add the `run` subcommand."""
    parser = subparsers.add_parser(
        "run", help="train an exported pipeline on several processes (wraps torchrun)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("export_dir", metavar="EXPORT_DIR",
                        help="a folder written by Pipeline.export / pdcompile export")
    parser.add_argument("--nproc", type=int, default=None,
                        help="worker processes on this node (default: the plan's workers / "
                             "--nnodes)")
    launch = parser.add_argument_group("launch (passed to torchrun)")
    launch.add_argument("--nnodes", default="1")
    launch.add_argument("--node-rank", type=int, default=None)
    launch.add_argument("--master-addr", default=None)
    launch.add_argument("--master-port", type=int, default=None)
    launch.add_argument("--rdzv-backend", default=None)
    launch.add_argument("--rdzv-endpoint", default=None)
    launch.add_argument("--rdzv-id", default=None)
    launch.add_argument("--max-restarts", type=int, default=0,
                        help="restart the workers this many times after a failure; with "
                             "--checkpoint-dir the run resumes from the last checkpoint")
    train = parser.add_argument_group("training (passed to the workers)")
    add_training_options(train, fault_timeout=None)
    parser.add_argument("--dry-run", action="store_true",
                        help="print the torchrun command instead of running it")
    parser.set_defaults(func=run)


def _idle_reason(plan: Plan) -> str:
    """The planner's words for the workers its plan leaves idle (": 1 of 2 workers ..."), or
    "" where the plan gives none."""
    reason = plan.extra.get("idle_workers")
    return f" ({reason})" if isinstance(reason, str) else ""


def _check_port_free(addr: str, port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((addr, port))
        except OSError:
            raise DistributedError(f"master port {port} on {addr} is already in use; pass a "
                                   "different --master-port, or none to pick a free one") from None


def _check_export(export_dir: Path, args: argparse.Namespace) -> tuple[int | None, Plan]:
    """Refuse, in one line and before any worker starts, an export that is damaged or cannot
    train as asked; the number of minibatches to pass the workers (None: all of --data), and
    the plan as checked (what the launch decides from: never plan.json read again)."""
    from pdcompile.cli.run_checks import check_data, check_options, check_resume
    from pdcompile.export.checked import checked_export
    from pdcompile.export.trust import check_imports

    check_options(args)
    checked = checked_export(export_dir)
    meta, plan = checked.meta, checked.plan
    # the modules the export names, from the files as checked (code, module records)
    check_imports(export_dir, meta, checked.code, trust=args.trust, trees=checked.trees,
                  manifest_data=checked.manifest.data)
    _check_every_rank_runs(export_dir, plan)
    check_resume(export_dir, args.checkpoint_dir, args.steps, plan.workers)
    lost = meta.get("not_saved", {})
    if lost:
        what = " and ".join(lost)
        raise PdcompileError(
            f"the {what} of {export_dir} could not be saved at export "
            f"({'; '.join(lost.values())}), so the workers cannot rebuild it; compile with one "
            "that has an import path (e.g. torch.nn.functional.cross_entropy, any torch.optim "
            "optimizer) and export again")
    if args.data is not None:
        check_data(export_dir, args.data)  # one line here, not every worker's after seconds
        return args.steps, plan
    example = meta.get("example", {})
    if not example.get("inputs"):
        raise PdcompileError(f"{export_dir} holds no example minibatch to train on; pass "
                             "--data FILE.py:FUNCTION (FUNCTION() returns an iterable of "
                             "(inputs, target))")
    if meta.get("loss_fn") is not None and not example.get("target"):
        raise PdcompileError(
            f"{export_dir} holds the example inputs but no target for its loss function: pass "
            "compile(..., example_target=y), or call step/train once before export; or pass "
            "--data FILE.py:FUNCTION")
    if args.steps is None:
        print(f"pdcompile run: training on the exported example minibatch, {DEFAULT_STEPS} "
              "times (--steps N for another count, --data FILE.py:FUNCTION for real data)",
              file=sys.stderr, flush=True)
        return DEFAULT_STEPS, plan
    return args.steps, plan


def _check_every_rank_runs(export_dir: Path, plan: Plan) -> None:
    """One line before any worker starts, not one per worker: a plan with a rank that holds
    no stage cannot run on torch.distributed."""
    from pdcompile.backends.distributed import idle_rank_refusal

    refusal = idle_rank_refusal(plan)
    if refusal is not None:
        raise PdcompileError(f"{export_dir}: {refusal}")


def _is_loopback(endpoint: str) -> bool:
    """Whether a HOST[:PORT] rendezvous endpoint names this machine's loopback interface.
    (torch's `parse_rendezvous_endpoint` reads a bare `::1` as host `:` and port 1.)"""
    import ipaddress

    if endpoint.startswith("[") and "]" in endpoint:  # [IPv6]:PORT
        host = endpoint[1:endpoint.index("]")]
    else:  # HOST:PORT, HOST, or a bare IPv6 address
        host = endpoint.rsplit(":", 1)[0] if endpoint.count(":") == 1 else endpoint
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def torchrun_command(args: argparse.Namespace) -> list[str]:
    """The torchrun command line for `args` (see `register`)."""
    export_dir = Path(args.export_dir)
    steps, plan = _check_export(export_dir, args)
    nnodes = str(args.nnodes)
    single = nnodes == "1"
    workers = plan.workers
    nproc = args.nproc
    if nproc is None:
        nproc = workers // max(1, int(nnodes.split(":")[-1]))
    if nproc < 1:
        raise PdcompileError(f"--nproc must be a positive integer ({nproc} < 1)")
    if single and nproc > workers:
        # a plan that leaves workers idle (the planner found fewer faster): only its ranks run
        print(f"pdcompile run: the plan in {export_dir} uses {workers} of the {nproc} workers "
              f"asked for{_idle_reason(plan)}; starting {workers} process"
              f"{'es' if workers > 1 else ''}", file=sys.stderr, flush=True)
        nproc = workers
    if single and nproc != workers:
        raise PdcompileError(f"the pipeline in {export_dir} was compiled for {workers} workers, "
                             f"not --nproc {nproc}; pass --nproc {workers}")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}",
           f"--nproc-per-node={nproc}", f"--max-restarts={args.max_restarts}"]
    if args.rdzv_endpoint or args.rdzv_backend:
        cmd += [f"--rdzv-backend={args.rdzv_backend or 'c10d'}"]
        if args.rdzv_endpoint:
            cmd += [f"--rdzv-endpoint={args.rdzv_endpoint}"]
            if _is_loopback(args.rdzv_endpoint):  # every node is here: bootstrap on loopback
                cmd += ["--local-addr=127.0.0.1"]
        if args.rdzv_id:
            cmd += [f"--rdzv-id={args.rdzv_id}"]
    else:
        addr = args.master_addr or ("127.0.0.1" if single else None)
        if addr is None:
            raise PdcompileError("a multi-node run needs --master-addr (the address of node 0) "
                                 "or --rdzv-endpoint")
        port = args.master_port
        if port is None:
            if not single:
                raise PdcompileError("a multi-node run needs --master-port (the same on every "
                                     "node)")
            port = free_port()
        elif single:
            _check_port_free(addr, port)
        cmd += [f"--master-addr={addr}", f"--master-port={port}"]
        if args.node_rank is not None:
            cmd += [f"--node-rank={args.node_rank}"]
    cmd += ["-m", WORKER_MODULE, str(export_dir)]
    if args.slowdown:
        from pdcompile.runtime.slowdown import check_slowdowns

        check_slowdowns(args.slowdown, nproc * max(1, int(nnodes.split(":")[-1])))
    run_dir = args.run_dir or args.checkpoint_dir or default_run_dir(export_dir)
    forwarded = argparse.Namespace(**{**vars(args), "steps": steps, "run_dir": run_dir})
    cmd += training_arguments(forwarded)
    return cmd


def run(args: argparse.Namespace) -> int:
    """Build the torchrun command and run it (or print it with --dry-run)."""
    cmd = torchrun_command(args)
    if args.dry_run:
        print(shlex.join(cmd))
        return 0
    agent = [*cmd[:cmd.index("torch.distributed.run")], AGENT_MODULE,
             *cmd[cmd.index("torch.distributed.run") + 1:]]
    nproc = int(next(a for a in cmd if a.startswith("--nproc-per-node=")).split("=")[1])
    return supervise(agent, nproc=nproc)


def supervise(cmd: list[str], *, nproc: int, grace: float = 3.0) -> int:
    """Run the torchrun agent `cmd` and see that nothing it started outlives this process.

    SIGINT, SIGTERM or SIGHUP here: the agent gets SIGTERM (it stops its workers) and, if it
    has not ended `grace` seconds later, SIGKILL. SIGKILL here (nothing can run): the agent
    gets SIGTERM from the kernel (parent-death signal, Linux) and every worker sees this pid
    gone (`LAUNCHER_ENV`, backends/launch.end_with_launcher) and ends within a fraction of a
    second. A failed run ends in one line naming the rank that failed first.
    """
    from pdcompile.backends.launch import (
        CAUSE_ENV,
        LAUNCHER_ENV,
        TOKEN_ENV,
        parent_death_preexec,
        run_token,
    )
    from pdcompile.backends.torchrun_agent import REPORT_ENV

    with tempfile.TemporaryDirectory(prefix="pdcompile-run-") as tmp:
        report = Path(tmp) / "failures.json"
        env = {**os.environ, LAUNCHER_ENV: str(os.getpid()), REPORT_ENV: str(report),
               CAUSE_ENV: str(Path(tmp) / "cause.json")}
        if "--nnodes=1" in cmd and not env.get(TOKEN_ENV):  # several nodes share the user's
            env[TOKEN_ENV] = run_token()
        if nproc > 1:  # what torchrun would set, without its banner saying so
            env.setdefault("OMP_NUM_THREADS", "1")
        proc = subprocess.Popen(cmd, env=env, preexec_fn=parent_death_preexec(signal.SIGTERM))
        received: list[int] = []

        def forward(signum: int, frame: object) -> None:
            received.append(signum)
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)

        stopping = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
        previous = {sig: signal.signal(sig, forward) for sig in stopping}
        try:
            first: float | None = None
            while True:
                try:
                    code = proc.wait(timeout=0.1)
                    break
                except subprocess.TimeoutExpired:
                    pass
                if received:
                    first = first or time.monotonic()
                    if time.monotonic() - first > grace:
                        proc.kill()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        if received:
            name = signal.Signals(received[0]).name
            print(f"pdcompile run: stopped by {name}; the workers were stopped",
                  file=sys.stderr, flush=True)
            return 128 + received[0]
        if code != 0:
            raise DistributedError(_failure_line(report, code))
    return 0


def _json_in(path: Path) -> Any:
    """The JSON value `path` holds; ValueError where it holds none (no file, not a plain file,
    too large, not JSON, nested deeper than Python's parser goes). Read as a bounded plain file:
    a FIFO in its place would hang the last line of a failed run."""
    try:
        return json.loads(read_json_bytes(path, fix="the workers' messages above say why"))
    except (OSError, RecursionError) as err:
        raise ValueError(f"{path}: {err}") from None


def _is_rank(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _recorded_cause(path: Path) -> str | None:
    """The first cause the workers recorded (backends/launch.write_cause: {"rank": int,
    "reason": str}), as words; None where there is none of that shape."""
    from pdcompile.backends.launch import describe_cause

    try:
        data = _json_in(path)
    except ValueError:
        return None
    if not isinstance(data, dict) or not _is_rank(data.get("rank")) \
            or not isinstance(data.get("reason"), str):
        return None
    return describe_cause(data["rank"], data["reason"])


def _worker_failures(data: Any) -> list[dict[str, Any]] | None:
    """The agent's list of failed workers (backends/torchrun_agent: each a rank, a signal name or
    an exit code, a time), each as {"rank", "signal", "exitcode", "time"}; None where `data` is
    not such a list (the files are read back from disk: any JSON may be there)."""
    if not isinstance(data, list) or not data:
        return None
    failures = []
    for entry in data:
        if not isinstance(entry, dict) or not _is_rank(entry.get("rank")):
            return None
        signal_name, code, at = entry.get("signal") or None, entry.get("exitcode"), \
            entry.get("time")
        if signal_name is not None and not isinstance(signal_name, str):
            return None
        if signal_name is None and (not isinstance(code, int) or isinstance(code, bool)):
            return None
        if at is not None and (isinstance(at, bool) or not isinstance(at, int | float)
                               or not math.isfinite(at)):
            return None
        failures.append({"rank": entry["rank"], "signal": signal_name, "exitcode": code,
                         "time": at or 0})
    return failures


def _failure_line(report: Path, code: int) -> str:
    """One line naming the rank that failed first (from the agent's report, or the workers'
    record of the cause beside it); the generic line where neither is understood."""
    generic = (f"the distributed run failed (torchrun exit code {code}); the workers' errors "
               "are above")
    try:
        data = _json_in(report)
    except ValueError:
        return generic
    error = data.get("error") if isinstance(data, dict) else None
    if isinstance(error, str) and error.strip():  # {"error": ...}: the agent could not start
        return error
    cause = _recorded_cause(report.with_name("cause.json"))
    if cause is not None:  # the workers' own record of the first cause beats exit statuses
        return f"the distributed run failed: {cause}; the workers' messages are above"
    failures = _worker_failures(data)
    if failures is None:
        return generic
    # the agent stops the survivors of a failure with SIGTERM: those are not causes
    causes = [f for f in failures if f["signal"] != "SIGTERM"] or failures
    causes.sort(key=lambda f: (f["time"], f["rank"]))
    stopped = len(failures) - len(causes)

    def how(f: dict[str, Any]) -> str:
        return (f"rank {f['rank']} was killed by {f['signal']}" if f["signal"]
                else f"rank {f['rank']} exited with code {f['exitcode']}")

    rest = "".join(f", then {how(f)}" for f in causes[1:])
    others = f" ({stopped} other{'s' if stopped > 1 else ''} stopped)" if stopped else ""
    return (f"the distributed run failed: {how(causes[0])} first{rest}{others}; the workers' "
            "messages are above")
