"""Opaque event ids: a permutation the server reverses, whose ids look unrelated to the
numbers behind them and stay in what a browser's JavaScript holds exactly."""

from __future__ import annotations

import itertools
import random

from gpufleet.server.event_ids import MAX_SEQ, PLAIN, SPACE, Opaque


def _opaque(key: str | None = None) -> Opaque:
    ids = Opaque()
    ids.load(key or Opaque.fresh_key())
    return ids


def test_an_opaque_id_comes_back_as_its_number() -> None:
    ids = _opaque()
    numbers = [1, 2, 3, 1000, SPACE - 1, *random.Random(7).sample(range(1, SPACE), 2000)]
    shown = [ids.hide(n) for n in numbers]
    assert [ids.show(s) for s in shown] == numbers
    assert all(1 <= s <= SPACE < 2**53 for s in shown)
    assert len(set(shown)) == len(shown)


def test_neighbours_get_ids_far_apart_and_in_no_order() -> None:
    ids = _opaque("5a" * 32)  # a fixed key: the check below is about one permutation
    shown = [ids.hide(n) for n in range(1, 1001)]
    assert shown != sorted(shown) and shown != sorted(shown, reverse=True)
    assert sum(abs(b - a) < 2**40 for a, b in itertools.pairwise(shown)) < 5


def test_zero_is_the_start_and_past_every_id_is_past_every_record() -> None:
    ids = _opaque()
    assert ids.hide(0) == 0 and ids.show(0) == 0
    assert ids.show(SPACE + 1) == MAX_SEQ and ids.show(2**53 - 1) == MAX_SEQ
    assert PLAIN.hide(42) == PLAIN.show(42) == 42


def test_servers_with_one_key_agree_and_another_key_differs() -> None:
    key = Opaque.fresh_key()
    one, two, other = _opaque(key), _opaque(key), _opaque()
    assert [one.hide(n) for n in range(1, 50)] == [two.hide(n) for n in range(1, 50)]
    assert [one.hide(n) for n in range(1, 50)] != [other.hide(n) for n in range(1, 50)]
