"""The exceptions users catch."""

from __future__ import annotations


class MonarchError(Exception):
    """Base class of monarch_dsl's errors."""


class ActorError(MonarchError):
    """An endpoint (or an actor's constructor) raised. The actor survives.

    ``rank``: the flat rank of the failing actor in its actor mesh; ``point``: its coordinates;
    ``remote_traceback``: the traceback as printed on the worker; ``exception``: the original
    exception when it could be sent back (else None).
    """

    def __init__(self, message: str, *, rank=None, point=None, remote_traceback="", exception=None):
        super().__init__(message)
        self.rank = rank
        self.point = point
        self.remote_traceback = remote_traceback
        self.exception = exception

    def __str__(self) -> str:
        text = super().__str__()
        if self.remote_traceback:
            text += "\n\nremote traceback:\n" + self.remote_traceback.rstrip()
        return text


class SupervisionError(MonarchError):
    """A worker process died: every pending and later call that needs it fails with this.

    ``rank``: the dead worker's rank in its process allocation; ``coords``: its coordinates;
    ``stderr``: the end of what it wrote to stderr (local workers).
    """

    def __init__(self, message: str, *, rank=None, coords=None, stderr=""):
        super().__init__(message)
        self.rank = rank
        self.coords = coords
        self.stderr = stderr

    def __str__(self) -> str:
        text = super().__str__()
        if self.stderr:
            text += "\n\nits stderr ended with:\n" + self.stderr.rstrip()
        return text


class SpawnError(SupervisionError):
    """A worker could not start (its setup raised, it died, or it did not join in time)."""


class AttachError(MonarchError):
    """``md.attach(name)`` found no such persistent mesh, or its keeper refused (another
    controller holds it, or the secret did not match)."""


class RemoteError(MonarchError):
    """A tensor command failed on a worker; raised when its result (or anything computed from
    it) is fetched, or at ``stop()`` if nobody fetched it. ``rank``/``coords``: where it failed
    first; ``line``: the controller ``file:line`` that issued the failing command; ``op``: the
    operator; ``error``: the root cause as text; ``remote_traceback``."""

    def __init__(
        self, message: str, *, rank=None, coords=None, line="", op="", error="", remote_traceback=""
    ):
        super().__init__(message)
        self.rank = rank
        self.coords = coords
        self.line = line
        self.op = op
        self.error = error
        self.remote_traceback = remote_traceback


class PlanError(MonarchError):
    """A plan that cannot run as written (a check failed, an unsupported op, ...); the message
    names the user's ``file:line`` when the plan knows it (``loc``). Also
    ``monarch_dsl.compiler.plan.PlanError``."""

    def __init__(self, message: str, loc: str = "") -> None:
        super().__init__(f"{message} (at {loc})" if loc else message)
        self.loc = loc


class SpmdError(MonarchError):
    """A rank of ``pm.run_spmd`` failed (exited non-zero or was killed), or the run timed out;
    the other ranks were stopped. The mesh itself is unharmed.

    ``failures``: run rank -> exit code of every rank that failed on its own (negative: killed
    by that signal, as in ``subprocess``), first failure first; ``rank``/``coords``/``returncode``:
    that first failure (None after a timeout); ``stderr``: the end of its stderr;
    ``stopped``: the ranks stopped because of it; ``timed_out``: the run hit its ``timeout``.
    """

    def __init__(
        self,
        message: str,
        *,
        failures=None,
        rank=None,
        coords=None,
        returncode=None,
        stderr="",
        stopped=(),
        timed_out=False,
    ):
        super().__init__(message)
        self.failures = dict(failures or {})
        self.rank = rank
        self.coords = coords
        self.returncode = returncode
        self.stderr = stderr
        self.stopped = tuple(stopped)
        self.timed_out = timed_out

    def __str__(self) -> str:
        text = super().__str__()
        if self.stderr:
            text += "\n\nits stderr ended with:\n" + self.stderr.rstrip()
        return text


class CodeSyncError(MonarchError):
    """``pm.sync_code()`` could not bring the workers the new code; where it was not loaded,
    the old code keeps running.

    A module that does not compile is found on the controller, before anything is sent:
    ``path`` and ``line`` point at it. A module whose reload raised on some workers (an error
    at import time): ``module`` names it, ``ranks`` the workers where it failed (they rolled
    back to the old code), ``remote_traceback`` is the first one's traceback.
    """

    def __init__(
        self, message: str, *, path="", line=None, module="", ranks=(), remote_traceback=""
    ):
        super().__init__(message)
        self.path = path
        self.line = line
        self.module = module
        self.ranks = tuple(ranks)
        self.remote_traceback = remote_traceback

    def __str__(self) -> str:
        text = super().__str__()
        if self.remote_traceback:
            text += "\n\nremote traceback:\n" + self.remote_traceback.rstrip()
        return text
