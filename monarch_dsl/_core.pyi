"""The C++ runtime (cpp/). Only simple values cross this boundary: tensors, numbers, lists."""

from collections.abc import Sequence
from typing import Any

class Env:
    """A rank's value slots for one run of a plan (``Program.n_slots`` of them)."""

    def __init__(self, n: int) -> None: ...
    def set(self, slot: int, value: Any) -> None:
        """Put a tensor, a Python number, or None in ``slot``."""
    def __setitem__(self, slot: int, value: Any) -> None: ...
    def __getitem__(self, slot: int) -> Any:
        """The tensor / number in ``slot`` (None if empty)."""
    def get(self, slot: int) -> Any: ...
    def set_none(self, slot: int) -> None: ...
    def has(self, slot: int) -> bool: ...
    def __len__(self) -> int: ...

class Program:
    """The compute steps of a lowered plan, resolved once to dispatcher operators.

    ``steps``: per step, None (run by the caller: communication, or another rank's step) or
    ``(qualified op "aten::mm", overload "default", args, kwargs, outs, frees)`` where args may
    hold ``slot_type`` instances (``compiler.lower.Slot``) standing for slot values, alone or
    in a list (a Tensor[] argument). Constants are converted by the op's schema here, once.
    """

    def __init__(self, steps: Sequence[Any], slot_type: type) -> None: ...
    def run(self, env: Env, begin: int, end: int) -> int:
        """Run the compute steps in [begin, end) on ``env``, without the GIL: each step's
        results go to its out slots, and its last uses are freed. Returns -1, or the index of
        the step that raised (then ``last_error()`` says why)."""
    def last_error(self) -> str: ...
    def __len__(self) -> int: ...
