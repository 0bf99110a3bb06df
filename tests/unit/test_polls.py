"""Open long-polls: a newer poll of a worker ends the older one; a stop ends them all."""

from __future__ import annotations

import asyncio
import threading

from gpufleet.server.polls import Polls, wait_either


def test_a_newer_poll_ends_the_older_and_only_the_newest_counts() -> None:
    async def scenario() -> None:
        polls = Polls()
        old = polls.begin("w-1")
        other = polls.begin("w-2")
        new = polls.begin("w-1")
        assert old.over.is_set() and not new.over.is_set() and not other.over.is_set()
        assert polls.end("w-1", old) is False  # superseded: the newer one still counts
        assert len(polls) == 2
        assert polls.end("w-1", new) is True and len(polls) == 1

    asyncio.run(scenario())


def test_a_stop_from_another_thread_ends_every_poll_and_refuses_new_ones() -> None:
    async def scenario() -> None:
        polls = Polls()
        polls.bind(asyncio.get_running_loop())
        open_polls = [polls.begin(f"w-{n}") for n in range(3)]
        thread = threading.Thread(target=polls.request_stop)
        thread.start()
        thread.join(5)
        await asyncio.wait_for(asyncio.gather(*(p.over.wait() for p in open_polls)), 5)
        assert polls.stopping and polls.begin("w-9").over.is_set()

    asyncio.run(scenario())


def test_wait_either_returns_on_the_first_event_or_the_timeout() -> None:
    async def scenario() -> None:
        first, second = asyncio.Event(), asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.call_later(0.05, second.set)
        started = loop.time()
        await wait_either(first, second, 5.0)
        assert loop.time() - started < 1.0
        second.clear()
        started = loop.time()
        await wait_either(first, second, 0.05)
        assert 0.04 <= loop.time() - started < 1.0

    asyncio.run(scenario())
