"""The order in which MindSpore's redistribution loop visits tensor dims.

`RedistributionOperatorInfer` keeps its pending dims in a `mindspore::HashMap<uint64_t,
int64_t>` (tensor dim -> current device axis), which is `robin_hood::unordered_map` in MindSpore
builds, and walks it with iterators while it erases and re-inserts entries. So the order of
independent ops in its lists (which axis is gathered first) is the slot order of that hash
table, not the dim order. `SlotMap` reproduces the table (robin_hood 3.11: murmur3-style integer
hash, an extra multiply-shift in `keyToIdx`, 8 initial buckets, load factor 80 %, an overflow
buffer instead of wrap-around, backward-shift deletion) for the few integer keys a
redistribution has, so that the planner emits MindSpore's lists op for op.

Iteration follows the C++ loops: a position is a slot index; `erase(pos)` returns the same
slot when a later entry was shifted into it, else the next occupied slot.
"""

from __future__ import annotations

_MASK64 = (1 << 64) - 1
_HASH_MULTIPLIER = 0xC4CEB9FE1A85EC53  # robin_hood's initial mHashMultiplier
_INFO_BITS = 5  # InitialInfoNumBits
_INFO_INC = 1 << _INFO_BITS  # InitialInfoInc
_INITIAL_BUCKETS = 8  # InitialNumElements
_MAX_LOAD_PERCENT = 80  # MaxLoadFactor100


def _hash_int(key: int) -> int:
    """robin_hood::hash_int: the first three steps of murmur3's 64-bit finalizer."""
    x = key & _MASK64
    x ^= x >> 33
    x = (x * 0xFF51AFD7ED558CCD) & _MASK64
    x ^= x >> 33
    return x


def _max_allowed(buckets: int) -> int:
    return buckets * _MAX_LOAD_PERCENT // 100


class SlotMap:
    """A `robin_hood::unordered_map<uint64_t, int64_t>` reduced to what the loop uses: insert
    or assign, erase at a position, iteration by slot."""

    def __init__(self) -> None:
        self._buckets = 0
        self._info: list[int] = []
        self._keys: list[int] = []
        self._values: list[int] = []
        self._count = 0
        self._held: dict[int, int] = {}  # value -> how many entries hold it

    # -- layout of the table --------------------------------------------------------------------
    def _init(self, buckets: int) -> None:
        self._buckets = buckets
        slots = buckets + min(_max_allowed(buckets), 0xFF) + 1  # overflow buffer, sentinel
        self._info = [0] * slots
        self._keys = [0] * slots
        self._values = [0] * slots
        self._count = 0

    def _key_to_idx(self, key: int) -> tuple[int, int]:
        h = (_hash_int(key) * _HASH_MULTIPLIER) & _MASK64
        h ^= h >> 33
        return (h >> _INFO_BITS) & (self._buckets - 1), _INFO_INC + (h & (_INFO_INC - 1))

    def _find(self, key: int) -> int:
        if not self._buckets:
            return -1
        idx, info = self._key_to_idx(key)
        while info < self._info[idx]:
            idx, info = idx + 1, info + _INFO_INC
        while info == self._info[idx]:
            if self._keys[idx] == key:
                return idx
            idx, info = idx + 1, info + _INFO_INC
        return -1

    def _hold(self, value: int, change: int) -> None:
        self._held[value] = self._held.get(value, 0) + change

    def _place(self, key: int, value: int) -> int:
        """Insert a key known to be absent (robin_hood's insert path: skip richer entries,
        shift the poorer ones up by one slot)."""
        idx, info = self._key_to_idx(key)
        while info <= self._info[idx]:
            idx, info = idx + 1, info + _INFO_INC
        spot, spot_info = idx, info
        while self._info[idx]:
            idx += 1
        for j in range(idx, spot, -1):  # shiftUp
            self._keys[j], self._values[j] = self._keys[j - 1], self._values[j - 1]
            self._info[j] = self._info[j - 1] + _INFO_INC
        self._keys[spot], self._values[spot], self._info[spot] = key, value, spot_info
        self._count += 1
        return spot

    def _grow(self) -> None:
        old = [(k, v) for k, v, i in zip(self._keys, self._values, self._info) if i]
        held = self._held
        self._init(self._buckets * 2 if self._buckets else _INITIAL_BUCKETS)
        self._held = held
        for key, value in old:  # rehashPowerOfTwo: re-insert in old slot order
            self._place(key, value)

    # -- the operations the loop uses ------------------------------------------------------------
    def set(self, key: int, value: int) -> None:
        """`map_[key] = value`."""
        idx = self._find(key)
        if idx >= 0:
            self.assign(idx, value)
            return
        if self._count >= _max_allowed(self._buckets):
            self._grow()
        self._place(key, value)
        self._hold(value, 1)

    def get(self, key: int) -> int:
        return self._values[self._find(key)]

    def begin(self) -> int:
        return self._advance(0)

    def _advance(self, pos: int) -> int:
        end = len(self._info) - 1  # the sentinel slot
        while pos < end and not self._info[pos]:
            pos += 1
        return pos

    def end(self) -> int:
        return len(self._info) - 1 if self._info else 0

    def next(self, pos: int) -> int:
        return self._advance(pos + 1)

    def item(self, pos: int) -> tuple[int, int]:
        return self._keys[pos], self._values[pos]

    def assign(self, pos: int, value: int) -> None:
        self._hold(self._values[pos], -1)
        self._hold(value, 1)
        self._values[pos] = value

    def erase(self, pos: int) -> int:
        """Erase the entry at `pos` (backward-shift deletion); the position to continue at."""
        self._hold(self._values[pos], -1)
        idx = pos
        while self._info[idx + 1] >= 2 * _INFO_INC:
            self._info[idx] = self._info[idx + 1] - _INFO_INC
            self._keys[idx], self._values[idx] = self._keys[idx + 1], self._values[idx + 1]
            idx += 1
        self._info[idx] = 0
        self._count -= 1
        return pos if self._info[pos] else self.next(pos)

    def __len__(self) -> int:
        return self._count

    def holds(self, value: int) -> bool:
        """Whether some entry has `value` (`std::any_of` over the map)."""
        return self._held.get(value, 0) > 0
