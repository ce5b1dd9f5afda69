import gc
import os
import time

import pytest

os.environ.setdefault("MONARCH_DSL_QUIET", "1")
# Workers of the tests run on the CPU, on a GPU machine too (a 4-rank mesh on a host with fewer
# GPUs would be refused); the gpu-marked tests ask for CUDA (spawn_procs(env={"MD_DEVICE":
# "cuda"})).
os.environ.setdefault("MD_DEVICE", "cpu")
# "cpu-local" is the placeholder profile in the tests, whatever `monarch-dsl calibrate` wrote
# for the user (a directory that has no profile; tests that want one set their own).
os.environ["MONARCH_DSL_PROFILE_DIR"] = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "no-such-profile-dir"
)


def wait_until(predicate, timeout=10.0, what="condition"):
    """Poll ``predicate`` until true; fail after ``timeout`` s (for facts with no event to wait on,
    such as a process of someone else's disappearing)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def doubling_search(start: int, stop: int = 1 << 50):
    """The tutorial's "search what works" loop, under an active mesh: ``torch.empty`` sizes
    doubling until one fails. Returns (the largest that worked, the RemoteError)."""
    import torch

    import monarch_dsl as md

    size, largest = start, None
    while size <= stop:
        try:
            md.inspect(torch.empty(size)[:1])
            largest = size
            size *= 2
        except md.RemoteError as e:
            return largest, e
    raise AssertionError(f"no allocation failed, up to {stop} elements")


# torch 2.13's gloo sometimes aborts a rank at interpreter exit, after the script has finished
# and destroyed its process group: a gloo worker thread frees a finished collective's work, whose
# saved thread-local state holds a Python object, while the interpreter finalizes; taking the GIL
# then ends the thread inside a noexcept destructor (a core dump of plain torchrun showed
# ProcessGroupGloo::runLoop -> ~AsyncWork -> ~ThreadLocalState -> gil_scoped_acquire ->
# pthread_exit -> std::terminate). About 1 run in 16-40 of a small DDP script under load, plain
# torchrun included. It is the peer's bug: tests that run such scripts accept it from plain
# torchrun once the script's output is complete, and run ours once more on exactly that abort.
TORCH_GLOO_EXIT_ABORT = "terminate called without an active exception"


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state != "Z"
    except (FileNotFoundError, ProcessLookupError):  # (gone, or reaped between open and read)
        return False


@pytest.fixture
def executors():
    """Executors made in this process by a test, closed after it: their gloo groups and
    threads must end in this process, not in the workers that later tests fork from it."""
    made = []
    yield made
    for ex in made:
        ex.close()
    gc.collect()


def local_mesh(sizes: dict[str, int], scope: str = "module"):
    """A fixture: a process mesh of ``sizes`` on this host, for the tests of its ``scope``;
    stopped after them, whether they passed or not. In a test module: ``pm =
    local_mesh({"dp": 2})``, and its tests take ``pm``."""

    @pytest.fixture(scope=scope)
    def mesh():
        import monarch_dsl as md

        pm = md.this_host().spawn_procs(sizes)
        try:
            yield pm
        finally:
            pm.stop()

    return mesh


mesh4 = local_mesh({"host": 2, "gpu": 2}, scope="function")


def pytest_addoption(parser):
    parser.addoption(
        "--update-golden",
        action="store_true",
        help="rewrite tests/golden/*.plan from the current compiler instead of comparing",
    )


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` need CUDA: skipped on machines without a GPU (CI has none)."""
    import torch

    if torch.cuda.device_count() > 0:  # (NVML where it can: this process may fork later)
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
