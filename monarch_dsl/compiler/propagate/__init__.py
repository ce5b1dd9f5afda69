"""Pass: propagate placements through the plan and insert the communication they need.

- ``propagation``: the pass, ``propagate(plan, placements, ...)``;
- ``state``: the walk over the plan, one instruction at a time;
- ``registry`` and ``rules/``: the sharding rules, by op, one module per op family;
- ``redistribute``: the redistribution planner (which steps, from one layout to another).

The cost model is ``compiler.cost``; facts about ops by name (aliasing, writes in place) are
``compiler.ops``.
"""

from monarch_dsl.compiler.ops import ALIASING, FOREACH, written
from monarch_dsl.compiler.plan import MB
from monarch_dsl.compiler.propagate.propagation import propagate
from monarch_dsl.compiler.propagate.registry import Ctx, DimType, Strategy, rule, strategies

__all__ = [
    "ALIASING",
    "FOREACH",
    "MB",
    "Ctx",
    "DimType",
    "Strategy",
    "propagate",
    "rule",
    "strategies",
    "written",
]
