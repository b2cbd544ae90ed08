"""The target's KV cache: one preallocated tensor of sequence slots, written in place.

Layout: keys and values are each [L, S, h_kv, C, d] (layers, slots, key/value heads,
capacity in tokens, head dim). A sequence owns one slot from `allocate` until `release`;
its committed tokens occupy positions [0, length) of the slot, and a verification forward
writes the tree's n entries at [length, length + n). Nothing is ever concatenated: a step
reads a view of the valid prefix and writes into the rows after it. After acceptance,
`compact` gathers the accepted rows right behind the prefix (through a temporary, since the
source and destination ranges overlap), for every layer in one indexing op.

Several slots share the tensor so that a batched step can verify every running sequence's
tree in one forward (each tree attends only to its own slot). Positions a sequence never wrote
hold zeros (`_storage`): one attention call for several one-token rows reads each slot up to
the longest row and masks the rest (engine.attention.DecodeBatch), and a mask cannot hide a NaN.
"""
from __future__ import annotations

import torch


class CacheCapacityError(ValueError):
    """A write would run past a slot's capacity (the message names the numbers)."""


class SlotsExhaustedError(RuntimeError):
    """Every slot of the pool is held by a sequence."""


#: A CPU tensor this large (bytes) comes from the OS as fresh, zeroed pages (glibc serves
#: allocations over 32 MiB with mmap at any setting of its adaptive threshold).
ZEROED_BY_OS_BYTES = 64 << 20


def _storage(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zero tensor of `shape`. A large CPU one is allocated with torch.empty: its pages come
    zeroed from the OS and stay untouched until written, so a long capacity costs address
    space, not memory. Anything smaller, or on another device (whose caching allocator reuses
    freed blocks), is zero-filled."""
    t = torch.empty(shape, dtype=dtype, device=device)
    if t.device.type != "cpu" or t.numel() * t.element_size() < ZEROED_BY_OS_BYTES:
        t.zero_()
    return t


class KVPool:
    """Preallocated KV storage for `slots` sequences of up to `capacity` tokens each.

    keys, values: [num_layers, slots, kv_heads, capacity, head_dim] in `dtype` on `device`.
    Raises ValueError for a non-positive size.
    """

    def __init__(self, num_layers: int, slots: int, kv_heads: int, capacity: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        if min(num_layers, slots, kv_heads, capacity, head_dim) < 1:
            raise ValueError(f"every KV pool dimension must be >= 1, got layers={num_layers} slots={slots} "
                             f"kv_heads={kv_heads} capacity={capacity} head_dim={head_dim}")
        shape = (num_layers, slots, kv_heads, capacity, head_dim)
        self.keys = _storage(shape, dtype, device)
        self.values = _storage(shape, dtype, device)
        self.capacity = int(capacity)
        self.num_slots = int(slots)
        self._free = list(range(slots - 1, -1, -1))  # pop() hands out slot 0 first

    @property
    def free_slots(self) -> int:
        """Slots not held by any sequence."""
        return len(self._free)

    def allocate(self) -> int:
        """Hand out a free slot index. Raises SlotsExhaustedError when none is free."""
        if not self._free:
            raise SlotsExhaustedError(f"all {self.num_slots} KV slots are in use")
        return self._free.pop()

    def grow(self, slots: int) -> None:
        """Enlarge the pool to `slots` slots, keeping every held slot's contents and index.

        Allocates the larger tensors and copies the old ones (a cost paid once, when more
        sequences run at a time than the pool was built for). Raises ValueError when shrinking.
        """
        if slots < self.num_slots:
            raise ValueError(f"a KV pool cannot shrink from {self.num_slots} to {slots} slots")
        if slots == self.num_slots:
            return
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = _storage((old.shape[0], slots) + tuple(old.shape[2:]), old.dtype, old.device)
            new[:, : self.num_slots] = old
            setattr(self, name, new)
        self._free = list(range(slots - 1, self.num_slots - 1, -1)) + self._free
        self.num_slots = int(slots)

    def release(self, slot: int) -> None:
        """Give a slot back (its contents become garbage). Raises ValueError for a slot not held."""
        if not 0 <= slot < self.num_slots or slot in self._free:
            raise ValueError(f"KV slot {slot} is not allocated")
        self._free.append(slot)

    def slot_views(self, slot: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views [L, kv_heads, end, head_dim] of keys and values at positions [0, end) of `slot`,
        every layer, no copy: a forward reads the prefix and writes its new rows through them.

        Raises CacheCapacityError when the slot cannot hold `end` tokens (before anything is written).
        """
        if end > self.capacity:
            raise CacheCapacityError(f"{end} tokens do not fit a KV slot of {self.capacity}")
        return self.keys[:, slot, :, :end], self.values[:, slot, :, :end]

    def compact(self, slot: int, prefix_len: int, path: list[int], index: torch.Tensor | None = None) -> None:
        """Keep the tree rows `path` right behind the prefix of `slot`, in that order.

        path: accepted tree-node indices (0 = the root, written at prefix_len); index: the same
        as [m] int64 on the pool's device (avoids a host-to-device copy), or None. After the
        call positions [prefix_len, prefix_len + m) hold rows prefix_len + path. A path that is
        already the first m rows (a chain, or one token) needs no move. The gather reads into
        a temporary first, since the ranges overlap.
        """
        m = len(path)
        if path == list(range(m)):
            return
        if index is None:
            index = torch.tensor(path, dtype=torch.long, device=self.keys.device)
        src = index + prefix_len
        for kv in (self.keys, self.values):
            rows = kv[:, slot].index_select(2, src)  # [L, h, m, d], a temporary
            kv[:, slot, :, prefix_len:prefix_len + m] = rows
