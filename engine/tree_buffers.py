"""Per-bucket tree buffers: a step's tree indices reach the device in one copy into reused storage.

Each step verifies a tree of n nodes. Instead of allocating and copying tokens, parents and
position ids separately, the engine writes them into one preallocated [4, capacity] int64
host buffer (pinned on CUDA) and copies it to the device with a single non-blocking copy.
Capacity is the tree size rounded up to a bucket (a power of two, at least MIN_BUCKET), so a
few buffers serve every step. The ancestor matrix gets a preallocated [capacity, capacity]
bool buffer on the device as well.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.attention import TreeAttention, ancestor_matrix_device

#: Smallest buffer capacity (tree nodes).
MIN_BUCKET = 16
#: Rows of the packed index buffer.
ROW_TOKENS, ROW_PARENTS, ROW_DEPTHS, ROW_POSITIONS = range(4)


def bucket_capacity(n: int, minimum: int = MIN_BUCKET) -> int:
    """Buffer capacity for a tree of n nodes: the smallest power of two >= max(n, minimum).

    Raises ValueError for n < 1.
    """
    if n < 1:
        raise ValueError(f"a tree has at least one node, got n={n}")
    cap = max(1, minimum)
    while cap < n:
        cap *= 2
    return cap


@dataclass
class DeviceTree:
    """One step's tree on the device: views into a `TreeBuffers`, valid until its next `load`.

    tokens, parents, depths: [n] int64 (parents[0] = -1); position_ids: [1, n] int64
    (prefix_len + depth); prefix_len: cached tokens before the tree; max_depth: the tree's
    depth (host int, so building the ancestors needs no sync).
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    position_ids: torch.Tensor
    prefix_len: int
    max_depth: int
    _ancestor_out: torch.Tensor | None = field(default=None, repr=False)
    _ancestors: torch.Tensor | None = field(default=None, repr=False)

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def device(self) -> torch.device:
        return self.tokens.device

    @property
    def ancestors(self) -> torch.Tensor:
        """[n, n] bool: (i, j) True when node j is node i or an ancestor; built once, on the device."""
        if self._ancestors is None:
            self._ancestors = ancestor_matrix_device(self.parents, self.max_depth, self.device, self._ancestor_out)
        return self._ancestors

    def attention(self) -> TreeAttention:
        """The TreeAttention of this tree (shares the ancestor matrix)."""
        return TreeAttention(self.prefix_len, self.ancestors)

    def additive_mask(self, dtype: torch.dtype) -> torch.Tensor:
        """[1, 1, n, prefix_len + n] additive mask built on the device: 0 where visible, else the
        dtype's most negative value (the same values as engine.tree.tree_attention_mask)."""
        vis = self.attention().visible()
        mask = torch.zeros(vis.shape, dtype=dtype, device=self.device)
        return mask.masked_fill_(~vis, torch.finfo(dtype).min)


class TreeBuffers:
    """Preallocated storage for trees of up to `capacity` nodes on `device`.

    host: [4, capacity] int64 rows tokens, parents, depths, positions (pinned on CUDA);
    device_buf: its device copy (the host buffer itself on a CPU device);
    ancestors: [capacity, capacity] bool on the device.
    """

    def __init__(self, capacity: int, device: torch.device | str):
        self.capacity = int(capacity)
        self.device = torch.device(device)
        on_cpu = self.device.type == "cpu"
        self.host = torch.empty((4, self.capacity), dtype=torch.long, pin_memory=not on_cpu and
                                torch.cuda.is_available())
        self.device_buf = self.host if on_cpu else torch.empty_like(self.host, device=self.device)
        self.ancestors = torch.empty((self.capacity, self.capacity), dtype=torch.bool, device=self.device)
        self._copied: torch.cuda.Event | None = None

    def load(self, tree, prefix_len: int) -> DeviceTree:
        """Write `tree` (an engine.tree.Tree, host tensors) into the buffers and copy them once.

        Returns a DeviceTree of views into this buffer; the previous DeviceTree of this buffer
        is overwritten. Raises ValueError when the tree exceeds the capacity.
        """
        n = tree.size
        if n > self.capacity:
            raise ValueError(f"tree of {n} nodes does not fit a buffer of {self.capacity}")
        if self._copied is not None:
            # The last non-blocking copy may still read the pinned buffer we are about to rewrite.
            self._copied.synchronize()
        h = self.host
        h[ROW_TOKENS, :n] = tree.tokens
        h[ROW_PARENTS, :n] = tree.parents
        h[ROW_DEPTHS, :n] = tree.depths
        torch.add(tree.depths, prefix_len, out=h[ROW_POSITIONS, :n])
        d = self.device_buf
        if d is not h:
            # The whole buffer is contiguous: one copy, no staging through pageable memory.
            d.copy_(h, non_blocking=True)
            if self.device.type == "cuda":
                self._copied = torch.cuda.Event()
                self._copied.record()
        max_depth = int(tree.depths.max()) if n else 0
        return DeviceTree(tokens=d[ROW_TOKENS, :n], parents=d[ROW_PARENTS, :n], depths=d[ROW_DEPTHS, :n],
                          position_ids=d[ROW_POSITIONS, :n][None], prefix_len=int(prefix_len), max_depth=max_depth,
                          _ancestor_out=self.ancestors[:n, :n])


class TreeBufferPool:
    """One `TreeBuffers` per bucket capacity on one device, created on first use and then reused."""

    def __init__(self, device: torch.device | str, minimum: int = MIN_BUCKET):
        self.device = torch.device(device)
        self.minimum = minimum
        self._buffers: dict[int, TreeBuffers] = {}

    def get(self, n: int) -> TreeBuffers:
        """The buffers for a tree of n nodes (capacity `bucket_capacity(n)`)."""
        cap = bucket_capacity(n, self.minimum)
        buf = self._buffers.get(cap)
        if buf is None:
            buf = self._buffers[cap] = TreeBuffers(cap, self.device)
        return buf

    def load(self, tree, prefix_len: int) -> DeviceTree:
        """`get(tree.size).load(tree, prefix_len)`."""
        return self.get(tree.size).load(tree, prefix_len)

    @property
    def capacities(self) -> list[int]:
        """Capacities allocated so far, ascending."""
        return sorted(self._buffers)
