"""A real notebook session (issue 14): a Jupyter kernel spawns a persistent mesh and trains a
few steps; the kernel is restarted (its process killed: the controller is gone); a new cell
attaches, finds the actors and the pinned weights, edits a module, syncs it, and sees the new
behaviour. Driven through jupyter_client, as a notebook front end drives a kernel."""

import os
import textwrap
import uuid

import pytest

jupyter_client = pytest.importorskip("jupyter_client")
pytest.importorskip("ipykernel")

from conftest import pid_alive, wait_until  # noqa: E402

from monarch_dsl.runtime import registry  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MODULE_V1 = textwrap.dedent(
    """
    import monarch_dsl as md

    class Greeter(md.Actor):
        def __init__(self):
            self.calls = 0

        @md.endpoint
        def hello(self):
            self.calls += 1
            return f"v1 #{self.calls}"
    """
)


def _run(kc, code: str, timeout: float = 120.0) -> str:
    """Execute a cell; its printed output (stdout), or fail with the cell's error."""
    out: list[str] = []
    errors: list[str] = []

    def hook(msg):
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream" and content["name"] == "stdout":
            out.append(content["text"])
        elif kind == "error":
            errors.append("\n".join(content["traceback"]))

    reply = kc.execute_interactive(textwrap.dedent(code), timeout=timeout, output_hook=hook)
    assert reply["content"]["status"] == "ok", "\n".join(errors)
    return "".join(out)


@pytest.fixture
def kernel(tmp_path, monkeypatch):
    rt = tmp_path / "rt"
    rt.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(rt))
    (tmp_path / "nbmod.py").write_text(MODULE_V1)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), ROOT]))
    km = jupyter_client.KernelManager(kernel_name="python3", transport="ipc")
    km.ip = str(tmp_path / "kernel")  # (ipc: the kernel's sockets are files with this prefix)
    km.start_kernel(cwd=str(tmp_path), env=env)
    names: list[str] = []
    try:
        yield km, tmp_path, names
    finally:
        km.shutdown_kernel(now=True)
        for name in names:  # a failed test: end the mesh it left
            rec = registry.read(name)
            if rec is not None and rec.alive():
                os.kill(rec.pid, 9)
                wait_until(lambda rec=rec: not pid_alive(rec.pid), 30, "the keeper to end")
            registry.remove(name)


def test_a_notebook_session_survives_a_kernel_restart(kernel):
    km, folder, names = kernel
    name = "nb" + uuid.uuid4().hex[:8]
    names.append(name)
    kc = km.client()
    kc.start_channels()
    kc.wait_for_ready(timeout=120)
    out = _run(
        kc,
        f"""
        import torch, monarch_dsl as md, nbmod
        pm = md.this_host().spawn_procs({{"gpu": 2}}, name={name!r}, persistent=True,
                                        idle_timeout=300)
        greeter = pm.spawn("greeter", nbmod.Greeter)
        print(list(greeter.hello.call().get().values()))
        with pm.activate():
            target = md.to_mesh(torch.tensor([1.0, 2.0, 3.0]), pm)
            w = md.to_mesh(torch.zeros(3), pm)
            for step in range(20):                # a few steps of gradient descent
                w = w - 0.25 * 2 * (w - target)   # d/dw |w - target|^2
            md.pin(w, "w")
            print("loss", round(md.inspect(((w - target) ** 2).sum(), gpu=0).item(), 6))
        """,
    )
    assert "v1 #1" in out and "loss 0.0" in out
    kc.stop_channels()

    km.restart_kernel(now=True)  # the kernel process is killed: the controller is gone
    kc = km.client()
    kc.start_channels()
    kc.wait_for_ready(timeout=120)
    out = _run(
        kc,
        f"""
        import torch, monarch_dsl as md
        pm = md.attach({name!r})
        greeter = pm.actors("greeter")
        print(list(greeter.hello.call().get().values()))  # state kept: the 2nd call
        w = pm.pinned("w")
        with pm.activate():
            print("w", [round(x, 4) for x in md.inspect(w, gpu=1).tolist()])
        """,
    )
    assert "v1 #2" in out
    assert "w [1.0, 2.0, 3.0]" in out
    (folder / "nbmod.py").write_text(MODULE_V1.replace('f"v1 #', 'f"v2 #'))
    out = _run(
        kc,
        """
        print(pm.sync_code())
        print(list(greeter.hello.call().get().values()))  # the edited code, the same actor
        pm.stop()
        """,
    )
    assert "v2 #3" in out, out
    kc.stop_channels()
    wait_until(lambda: registry.read(name) is None, 30, "the mesh's record to go")
