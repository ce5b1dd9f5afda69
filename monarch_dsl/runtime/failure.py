"""What a worker's executors and plan runner share about failures: the ``Failure`` a failed
ref holds. (A module of its own so that the executor and the plan runner, which the executor
drives, do not import each other.)"""

from __future__ import annotations

from monarch_dsl import isa


class Failure:
    """What a failed ref holds: the root cause (where it first failed)."""

    __slots__ = ("rank", "line", "op", "error", "traceback")

    def __init__(self, rank: int, line: str, op: str, error: str, tb: str):
        self.rank = rank
        self.line = line
        self.op = op
        self.error = error
        self.traceback = tb

    def as_tuple(self) -> tuple:
        return (self.rank, self.line, self.op, self.error, self.traceback)


# What a failure's ``op`` is when a communication itself raised (a peer process died, a
# timeout), as opposed to the user's op raising or a failed input: a compiled plan's
# communication steps (their ``kind``), the eager ``Reduce`` (``reduce ('dp',)``; its derived
# failure is ``reduce over ...``), ``Transfer`` (``to_mesh``), and a plan's run as a whole
# (its failure flag's all-reduce or a collective waited for at the end).
PLAN_COMMUNICATION = "plan communication"
_COMMUNICATION_OPS = frozenset(
    {step.kind for step in isa.STEPS if issubclass(step, isa.Comm)}
    | {"to_mesh", PLAN_COMMUNICATION}
)


def is_communication(failure: tuple) -> bool:
    """Whether ``failure`` (``Failure.as_tuple()``) is a communication that raised: the
    controller then looks for a dead worker that caused it (its peer vanished) before it
    blames this rank. (A transfer whose source had failed is that failure's consequence.)"""
    op, error = failure[2], failure[3]
    if error == "the source value had failed":
        return False
    return op in _COMMUNICATION_OPS or op.startswith("reduce (")
