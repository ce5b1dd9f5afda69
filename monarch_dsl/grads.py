"""``md.grad_generator``: gradients one at a time, so communication can start early."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator

import torch

from monarch_dsl.tensor import Tensor


def grad_generator(loss: Tensor, params: Iterable[torch.Tensor]) -> Iterator[Tensor]:
    """Yield the gradient of ``loss`` for each of ``params``, in the order given, issuing only
    the backward commands needed so far before each yield.

    Give the parameters in the order backward reaches them (``reversed(list(model
    .parameters()))`` for a plain stack of layers): then what the caller issues after each
    yield -- a reduce on a ``comms`` stream -- is sent before the rest of the backward pass and
    overlaps it on the workers. (In another order a gradient simply waits until backward has
    produced it.) The backward pass runs in a helper thread that pauses whenever the gradient
    the caller wants next is ready. ``.grad`` is not touched.
    """
    params = list(params)
    if not params:
        return
    grads: dict[int, torch.Tensor] = {}
    cond = threading.Condition()
    state: dict = {"next": 0, "stop": False, "done": False, "error": None}

    def hook_for(i: int):
        def hook(grad: torch.Tensor) -> None:
            with cond:
                grads[i] = grad
                cond.notify_all()
                # Pause until the caller is done with this gradient (it asks for the next
                # one): what it issues with it goes out before the rest of the backward pass,
                # in that order every time. Go on at once while the caller waits for an
                # earlier gradient backward has not produced (parameters out of order).
                cond.wait_for(
                    lambda: (
                        state["stop"]
                        or state["next"] > i
                        or (state["next"] < i and state["next"] not in grads)
                    )
                )

        return hook

    handles = [p.register_hook(hook_for(i)) for i, p in enumerate(params)]

    def run() -> None:
        try:
            # in this thread, as under activate(): a CUDA mesh tensor's backward must not go to
            # a device thread of the controller's own GPUs (see tensor/activation.py)
            with torch.autograd.set_multithreading_enabled(False):
                torch.autograd.grad(loss, params, allow_unused=True)
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            state["error"] = e
        with cond:
            state["done"] = True
            cond.notify_all()

    helper = threading.Thread(target=run, name="md-grad-generator", daemon=True)
    helper.start()
    try:
        for i in range(len(params)):
            with cond:
                cond.wait_for(lambda i=i: i in grads or state["done"])
                grad = grads.pop(i, None)
            if grad is None:
                if state["error"] is not None:
                    raise state["error"]
                raise ValueError(f"parameter #{i} does not contribute to the loss")
            yield grad
            with cond:
                state["next"] = i + 1
                cond.notify_all()
    finally:
        with cond:
            state["stop"] = True
            cond.notify_all()
        helper.join()
        for h in handles:
            h.remove()
