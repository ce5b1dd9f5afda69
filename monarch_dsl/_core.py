"""``monarch_dsl._core``: the C++ runtime, compiled from ``cpp/`` by ``monarch_dsl._build``.

Importing it loads the build (``python -m monarch_dsl._build`` or ``bash scripts/setup.sh``
makes it; importing never compiles). Its interface, with docstrings, is ``_core.pyi``.
"""

from monarch_dsl._build import load as _load

_module = _load(build=False)
Env = _module.Env
Program = _module.Program
ShmGroup = _module.ShmGroup

__all__ = ["Env", "Program", "ShmGroup"]
