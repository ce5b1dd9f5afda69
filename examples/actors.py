"""Actors on a local 4-process mesh: the quick start of the README.

python examples/actors.py
"""

import asyncio

import monarch_dsl as md


class Counter(md.Actor):
    def __init__(self, start: int):
        self.value = start

    @md.endpoint
    def incr(self, by: int = 1) -> int:
        self.value += by
        return self.value

    @md.endpoint
    def where(self) -> str:
        point = md.current_rank()
        return f"rank {point.rank} at {dict(point)}"

    @md.endpoint
    async def slow_double(self) -> int:
        await asyncio.sleep(0.01)
        return 2 * self.value

    @md.endpoint
    def fail(self):
        raise ValueError("this endpoint always fails")


def main() -> None:
    procs = md.this_host().spawn_procs({"host": 2, "gpu": 2})
    print(procs.to_table())

    counters = procs.spawn("counter", Counter, 10)
    print("call:", counters.incr.call(5).get())
    print("where (gpu=1 slice):", list(counters.slice(gpu=1).where.call().get().values()))
    print("call_one:", counters.slice(host=0, gpu=0).incr.call_one().get())
    print("choose:", counters.where.choose().get())
    print("stream:", sorted(counters.incr.stream()))
    counters.incr.broadcast(100)
    print("after broadcast:", counters.incr.call(0).get().item(host=1, gpu=1))
    print("async endpoint:", asyncio.run(_double(counters)))

    try:
        counters.slice(host=0, gpu=1).fail.call_one().get()
    except md.ActorError as e:
        print("ActorError:", str(e).splitlines()[0])
    print("still alive after the error:", counters.slice(host=0, gpu=1).incr.call_one(0).get())

    procs.stop()


async def _double(counters):
    return (await counters.slow_double.call()).values()


if __name__ == "__main__":
    main()
