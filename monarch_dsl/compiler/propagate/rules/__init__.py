"""The sharding rules, one module per op family; importing this package registers them all
(see ``propagate.registry``)."""

from monarch_dsl.compiler.propagate.rules import (  # noqa: F401
    attention,
    conv,
    embedding,
    factory,
    loss,
    matmul,
    norm,
    pointwise,
    pool,
    reduction,
    shape,
)
