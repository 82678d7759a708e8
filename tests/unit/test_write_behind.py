"""``WriteBehind``: a slow store's writes leave the caller's event loop at once and land
in the order they were made (a running turn's mark: put as the turn begins, deleted as
it ends; reordered, a stale mark would outlive the turn)."""

from __future__ import annotations

import asyncio
import threading
import time

from orchestrator.kv.durable import MemoryStore, WriteBehind


class SlowStore(MemoryStore):
    """Each write takes 20 ms and records which thread made it."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: set[int] = set()
        self.log: list[tuple[str, bytes | None]] = []

    def put(self, key: str, value: bytes) -> None:
        time.sleep(0.02)
        self.threads.add(threading.get_ident())
        self.log.append((key, value))
        super().put(key, value)

    def delete(self, key: str) -> None:
        time.sleep(0.02)
        self.threads.add(threading.get_ident())
        self.log.append((key, None))
        super().delete(key)


def test_writes_return_at_once_and_land_in_order_off_the_event_loop() -> None:
    store = SlowStore()
    marks = WriteBehind(store)

    async def story() -> list[tuple[str, bytes | None]]:
        for turn in range(5):
            marks.put("running/s1", f"{turn}".encode())
            marks.delete("running/s1")
        marks.put("running/s2", b"x")
        # Every call returned before any write was made (they wait for this loop to
        # yield, then run in a thread).
        made_before_yielding = list(store.log)
        await marks.flush()
        return made_before_yielding

    assert asyncio.run(story()) == []
    assert store.log == [
        *[
            entry
            for t in range(5)
            for entry in (("running/s1", f"{t}".encode()), ("running/s1", None))
        ],
        ("running/s2", b"x"),
    ]
    assert store.data == {"running/s2": b"x"}
    assert threading.get_ident() not in store.threads


def test_outside_an_event_loop_a_write_is_made_at_once() -> None:
    store = SlowStore()
    WriteBehind(store).put("running/s1", b"1")
    assert store.data == {"running/s1": b"1"}
