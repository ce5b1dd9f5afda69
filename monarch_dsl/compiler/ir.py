"""(Moving: the instruction set is ``monarch_dsl.isa``; this name goes once nothing uses it.)"""

from monarch_dsl.isa import *  # noqa: F403
from monarch_dsl.isa import INSTRUCTIONS, refs_in  # noqa: F401
