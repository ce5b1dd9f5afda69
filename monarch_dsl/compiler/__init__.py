"""The plan IR and the compiler passes. Pure: never imports the runtime."""

# Plan's text form (str / Plan.parse), checker (plan.check()) and simulator (plan.simulate(),
# plan.memory()) register themselves on import.
from monarch_dsl.compiler import check as _check  # noqa: F401
from monarch_dsl.compiler import simulate as _simulate  # noqa: F401
from monarch_dsl.compiler import text as _text  # noqa: F401
