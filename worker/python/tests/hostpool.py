"""A duck-typed SGLang host KV pool without torch, for the backend's tests.

It mirrors `MHATokenToKVPoolHost` of SGLang 0.5.23 (`pool_host/mha.py`) where the backend touches
it: `page_size`, `layout`, `layer_num`, `head_num`, `head_dim`, `dtype.itemsize`, `size`, and
`get_page_buffer_meta(indices)` with the same pointer formulas per layout (K then V per page for
the page-first layouts, a (K, V) pair per layer for `layer_first`). Its buffer is a memfd mapping,
as with SGLang's `"allocator": "shm"`. Host indices are token slots (a list; SGLang passes a tensor).
"""

import ctypes
import mmap
import os


class DType:
    def __init__(self, itemsize):
        self.itemsize = itemsize


class HostPool:
    def __init__(self, pages, page_size=512, layer_num=8, head_num=1, head_dim=16, itemsize=2, layout="page_first"):
        self.page_size, self.layer_num, self.head_num, self.head_dim = page_size, layer_num, head_num, head_dim
        self.dtype = DType(itemsize)
        self.layout = layout
        self.size = pages * page_size
        self.token_bytes = head_num * head_dim * itemsize  # one of K or V, one layer
        self.nbytes = 2 * layer_num * self.size * self.token_bytes
        self.fd = os.memfd_create("sgl-host-pool", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, self.nbytes)
        self.buf = mmap.mmap(self.fd, self.nbytes, flags=mmap.MAP_SHARED)
        self.base = ctypes.addressof(ctypes.c_char.from_buffer(self.buf))

    def get_page_buffer_meta(self, indices):
        indices = list(indices)
        assert len(indices) % self.page_size == 0
        tb, L = self.token_bytes, self.layer_num
        v_offset = L * self.size * tb
        ptrs = []
        if self.layout == "layer_first":
            for i in range(0, len(indices), self.page_size):
                for layer in range(L):
                    k = self.base + indices[i] * tb + layer * self.size * tb
                    ptrs += [k, k + v_offset]
            size = self.page_size * tb
        elif self.layout in ("page_first", "page_first_direct", "page_head"):
            for i in range(0, len(indices), self.page_size):
                k = self.base + indices[i] * L * tb
                ptrs += [k, k + v_offset]
            size = L * self.page_size * tb
        else:
            raise ValueError(self.layout)
        return ptrs, [size] * len(ptrs)

    def page_bytes(self, page):
        """The page's bytes as the backend sees them (its spans, concatenated)."""
        ptrs, sizes = self.get_page_buffer_meta(range(page * self.page_size, (page + 1) * self.page_size))
        return b"".join(ctypes.string_at(p, s) for p, s in zip(ptrs, sizes))

    def fill(self, seed):
        """Deterministic bytes over the whole pool."""
        import hashlib

        out = bytearray()
        i = 0
        while len(out) < self.nbytes:
            out += hashlib.sha256(f"{seed}:{i}".encode()).digest()
            i += 1
        self.buf[:] = bytes(out[: self.nbytes])

    def zero(self):
        self.buf[:] = bytes(self.nbytes)


def indices(pages, page_size=512):
    """Host token indices of whole pages `pages`."""
    return [p * page_size + t for p in pages for t in range(page_size)]


def chain_keys(n, salt=0, diverge_at=None, page_size=512):
    """SGLang-style chained page keys (get_hash_str: SHA-256 over the prior digest and each token id
    as 4 little-endian bytes), for `n` pages; token ids depend on `salt` from page `diverge_at`
    on (all pages when None), so two chains share exactly their first `diverge_at` pages."""
    import hashlib

    keys, prior = [], b""
    for p in range(n):
        h = hashlib.sha256(prior)
        s = salt if diverge_at is None or p >= diverge_at else 0
        for t in range(page_size):
            h.update(((p * 1000003 + t * 7 + s * 7919) & 0x7FFFFFFF).to_bytes(4, "little"))
        prior = h.digest()
        keys.append(h.hexdigest())
    return keys
