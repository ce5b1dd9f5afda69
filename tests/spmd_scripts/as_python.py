"""``as_python.py DIR``: what tests/test_spmd.py compares between ``python as_python.py DIR``
and a rank of ``run_spmd``: ``__builtins__`` (the builtins module in a real ``__main__``), a
file opened at module level and never closed (flushed when the interpreter tears ``__main__``
down), lines with carriage returns and form feeds, a file name that is not UTF-8, an
uncaught exception reported through the script's own ``sys.excepthook``, annotations as
objects (no ``from __future__`` of the runner's), and an atexit handler pickling a class of
the script (still ``__main__``'s)."""

import atexit
import os
import pickle
import sys

out_dir = sys.argv[1]
rank = os.environ.get("RANK", "python")
log = open(os.path.join(out_dir, f"{rank}.log"), "w")  # noqa: SIM115 - never closed, on purpose
log.write("written before exit\n")


def keeps_log():  # a function: its globals refer to it, a cycle only the teardown frees
    return log


print("builtins:", type(__builtins__).__name__)
print("progress 1/2\rprogress 2/2")
print("form\ffeed")
sys.stdout.flush()
print("name:", os.fsdecode(b"data_\xff.bin"))


def annotated(x: int) -> None:
    pass


print("annotations:", annotated.__annotations__)


class Config:
    pass


@atexit.register
def pickled():
    print("atexit pickled", type(pickle.loads(pickle.dumps(Config()))).__name__)


def hook(kind, value, tb):
    print("hook:", kind.__name__, value, file=sys.stderr)


sys.excepthook = hook
raise KeyError("raised at the end")
