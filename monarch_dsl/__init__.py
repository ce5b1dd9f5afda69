"""monarch_dsl: drive a mesh of processes (and their GPUs) from one Python program.

``import monarch_dsl as md``; the contract is SPEC.md.
"""

# torch first: every part of monarch_dsl works on torch tensors, and a controller that has
# imported torch lets the fork server (forked from it) start workers without importing it again.
import torch  # noqa: F401, I001

from monarch_dsl.actor import Actor, ActorMesh, EndpointRef, ValueMesh, endpoint
from monarch_dsl.errors import (
    ActorError,
    CodeSyncError,
    AttachError,
    MonarchError,
    PlanError,
    RemoteError,
    SpawnError,
    SpmdError,
    SupervisionError,
)
from monarch_dsl.mesh import Mesh
from monarch_dsl.proc_mesh import (
    LocalHost,
    ProcMesh,
    RemoteHosts,
    attach,
    remote_hosts,
    this_host,
)
from monarch_dsl.persistent import pin, unpin
from monarch_dsl.runtime.context import Point, current_rank
from monarch_dsl.runtime.debugger import debug
from monarch_dsl.tensor import (
    Borrow,
    Stream,
    Tensor,
    fetch,
    get_active_stream,
    inspect,
    reduce,
    reduce_,
    show,
    to_mesh,
)
from monarch_dsl.remote import RemoteFunction, remote
from monarch_dsl.grads import grad_generator
from monarch_dsl.compiler.plan import Partial, Placement, Plan, Replicate, Shard
from monarch_dsl.compiler.profile import DeviceProfile
from monarch_dsl.compiler.simulate import SimEvent, SimReport
from monarch_dsl.simulator import Simulator
from monarch_dsl.compiler.stages import pipeline_stage
from monarch_dsl.mesh_fn import MeshFunction, mesh_fn
from monarch_dsl.parallel.ddp import DistributedDataParallel
from monarch_dsl.parallel.distribute import distribute
from monarch_dsl.parallel.fsdp import fully_shard
from monarch_dsl.runtime.future import Future

__version__ = "0.1.0"

__all__ = [
    "Actor",
    "ActorError",
    "ActorMesh",
    "Borrow",
    "CodeSyncError",
    "DeviceProfile",
    "DistributedDataParallel",
    "EndpointRef",
    "Future",
    "LocalHost",
    "Mesh",
    "MeshFunction",
    "Partial",
    "Placement",
    "Plan",
    "PlanError",
    "Replicate",
    "Shard",
    "SimEvent",
    "SimReport",
    "Simulator",
    "mesh_fn",
    "pipeline_stage",
    "MonarchError",
    "Point",
    "ProcMesh",
    "RemoteError",
    "RemoteFunction",
    "reduce",
    "reduce_",
    "remote",
    "Tensor",
    "fetch",
    "get_active_stream",
    "grad_generator",
    "inspect",
    "show",
    "RemoteHosts",
    "SpawnError",
    "AttachError",
    "attach",
    "pin",
    "unpin",
    "SpmdError",
    "Stream",
    "SupervisionError",
    "ValueMesh",
    "current_rank",
    "debug",
    "distribute",
    "fully_shard",
    "endpoint",
    "remote_hosts",
    "this_host",
    "to_mesh",
]
