"""``md.pipeline_stage(i)``: mark where pipeline stage ``i`` starts, and tag the traced ops.

```python
with md.pipeline_stage(0):
    h = first_half(x)
with md.pipeline_stage(1):
    out = second_half(h)
loss = F.mse_loss(out, y)      # still stage 1: a marker starts a stage, the next one ends it
loss.backward()
```

While a step is traced, every op recorded gets ``node.meta["custom"]["md_stage"]`` and
``["md_phase"]`` (forward / backward / update). Forward ops take the stage of the last marker
entered. Backward ops take the stage of the forward op they differentiate: before the backward
runs, every autograd node of the graph gets a pre-hook that switches the current stage to
that node's stage (known from its sequence number: nodes are numbered in creation order, and
each marker records the number it started at). Outside tracing, markers do nothing.
"""

from __future__ import annotations

import bisect
import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx.traceback as fx_traceback
from torch.autograd.graph import Node
from torch.utils.hooks import RemovableHandle

_tls = threading.local()


class _Tracing:
    def __init__(self) -> None:
        self.starts: list[int] = []  # autograd sequence number at each marker, ascending
        self.stage_at: list[int] = []  # the stage each of those markers started
        self.used = False
        self.stack = contextlib.ExitStack()
        self.phase = "forward"
        self.stage: int | None = None

    def tag(self, stage: int | None) -> None:
        """From now on, recorded ops carry ``stage`` and the current phase."""
        self.stack.close()
        self.stack = contextlib.ExitStack()
        meta: dict[str, Any] = {"md_phase": self.phase}
        if stage is not None:
            meta["md_stage"] = stage
        self.stage = stage
        self.stack.enter_context(fx_traceback.annotate(meta))

    def stage_of_seq(self, seq: int) -> int:
        i = bisect.bisect_right(self.starts, seq) - 1
        return self.stage_at[i] if i >= 0 else (self.stage_at[0] if self.stage_at else 0)


@contextlib.contextmanager
def pipeline_stage(index: int) -> Iterator[None]:
    """Ops from here on belong to pipeline stage ``index`` (of the plan's pipeline dim)."""
    if not isinstance(index, int) or isinstance(index, bool) or index < 0:
        raise ValueError(f"md.pipeline_stage(index): index must be an int >= 0, got {index!r}")
    tracing: _Tracing | None = getattr(_tls, "tracing", None)
    if tracing is not None and tracing.phase == "forward":
        tracing.used = True
        tracing.starts.append(torch._C._autograd._get_sequence_nr())
        tracing.stage_at.append(index)
        tracing.tag(index)
    yield


@contextlib.contextmanager
def tracing_stages() -> Iterator[_Tracing]:
    """Active while a step is traced (inside make_fx): markers tag ops, and ``backward`` /
    ``autograd.grad`` calls tag theirs with the stage of what they differentiate."""
    tracing = _Tracing()
    _tls.tracing = tracing
    real_backward = torch.autograd.backward
    real_grad = torch.autograd.grad

    def run_backward(real: Callable[..., Any], tensors: Any, *args: Any, **kwargs: Any) -> Any:
        roots = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        handles = _hook_graph(tracing, [t.grad_fn for t in roots if t.grad_fn is not None])
        tracing.phase = "backward"
        tracing.tag(tracing.stage)  # (without stage markers, no node hook re-tags)
        try:
            return real(tensors, *args, **kwargs)
        finally:
            for h in handles:
                h.remove()
            tracing.phase = "update"  # what follows the backward is the optimizer's
            tracing.tag(None)

    def backward(tensors: Any, *args: Any, **kwargs: Any) -> Any:
        return run_backward(real_backward, tensors, *args, **kwargs)

    def grad(outputs: Any, *args: Any, **kwargs: Any) -> Any:
        return run_backward(real_grad, outputs, *args, **kwargs)

    with fx_traceback.preserve_node_meta():
        tracing.tag(None)
        torch.autograd.backward = backward
        torch.autograd.grad = grad
        try:
            yield tracing
        finally:
            torch.autograd.backward = real_backward
            torch.autograd.grad = real_grad
            tracing.stack.close()
            _tls.tracing = None


def _hook_graph(tracing: _Tracing, roots: list[Node]) -> list[RemovableHandle]:
    """Pre-hooks on every autograd node reachable from ``roots``: each switches the current
    stage to its node's before the node's backward ops are recorded."""
    if not tracing.used:
        return []
    handles: list[RemovableHandle] = []
    seen: set[int] = set()
    todo: list[tuple[Node | None, int | None]] = [(r, None) for r in roots]
    while todo:
        node, parent_stage = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        seq = node._sequence_nr()
        # AccumulateGrad (a leaf's gradient) has no forward op: its consumer's stage.
        is_leaf = type(node).__name__ == "AccumulateGrad"
        stage = parent_stage if is_leaf and parent_stage is not None else tracing.stage_of_seq(seq)

        def hook(grad_outputs: Any, stage: int = stage) -> None:
            tracing.tag(stage)

        handles.append(node.register_prehook(hook))
        for child, _ in node.next_functions:
            todo.append((child, stage))
    return handles
