"""The one exception family a user sees: each message names the culprit and the way out."""

from __future__ import annotations


class PdcompileError(Exception):
    """Base of every error pdcompile raises on purpose (the CLI prints it as one line, exit 1)."""


class ClusterError(PdcompileError, ValueError):
    """A cluster string, file or preset that cannot be understood."""


class CostGraphError(PdcompileError, ValueError):
    """A CostGraph that the planner cannot use (empty, cyclic, negative costs...)."""


class ProfileError(PdcompileError, ValueError):
    """A PipeDream profile file with a broken line (message carries file:line)."""


class TraceError(PdcompileError):
    """A model torch.fx cannot trace (message names module, source line and the fix)."""


class MetaMissingError(PdcompileError, KeyError):
    """A pass read a node.meta key that the pass writing it has not yet written."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class PlanError(PdcompileError, ValueError):
    """No plan exists (memory) or the planner was asked something impossible."""


class ScheduleError(PdcompileError, ValueError):
    """A schedule that deadlocks, misses or duplicates work (message has the rank x step grid)."""


class PipelineInputError(PdcompileError, ValueError):
    """Inputs that do not match what the pipeline was compiled for."""


class AnnouncedInputError(PipelineInputError):
    """Bad data that another rank read and refused, learned from its announcement: that rank
    (`reader`) says what was wrong; this one only stops, so that the message appears once."""

    def __init__(self, message: str, *, reader: int) -> None:
        super().__init__(message)
        self.reader = reader


class DistributedError(PdcompileError, RuntimeError):
    """A distributed run that cannot go on (dead peer, port in use, unreachable master)."""


class DamagedFileError(PdcompileError, ValueError):
    """A file pdcompile wrote (export, checkpoint) that is truncated, altered or not its own."""


class MeasurementError(PdcompileError, RuntimeError):
    """Measuring this machine (loopback, CPU) failed or did not finish in its time."""
