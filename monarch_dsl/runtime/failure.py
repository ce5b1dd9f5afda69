"""What a worker's executors and plan runner share about failures: the ``Failure`` a failed
ref holds. (A module of its own so that the executor and the plan runner, which the executor
drives, do not import each other.)"""

from __future__ import annotations


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
