"""Mooncake's Python TransferEngine on loopback, as `tandem-bench transfer --against mooncake` drives it.

The path SGLang's Mooncake backend uses: `TransferEngine.initialize(host, "P2PHANDSHAKE", "tcp", "")`,
`register_memory(addr, len)` on both sides, then `batch_transfer_sync_write(target, srcs, dsts, lens)`
with target `"127.0.0.1:<get_rpc_port()>"`. One process, two engines (target and initiator): the
engines move bytes on their own C++ threads over a loopback TCP connection, as two processes would.

Same workload as the Tandem rows: `pages` pages of `page` bytes written into `slots` rotating
destination pages, batches of `batch` pages, one batch in flight (the call is synchronous). One
warm-up batch (handshake, connection) is not timed. Every destination page is checked afterwards.

Usage: python mooncake_transfer.py PAGE_BYTES PAGES REPS BATCH SLOTS
Prints one line per repetition: `gbps=<float>` (10^9 bytes per second); exits non-zero on failure.
"""

import ctypes
import sys
import time

from mooncake.engine import TransferEngine


def main() -> int:
    page, pages, reps, batch, slots = (int(a) for a in sys.argv[1:6])
    target = TransferEngine()
    initiator = TransferEngine()
    for name, e in (("target", target), ("initiator", initiator)):
        rc = e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
        if rc != 0:
            print(f"{name} initialize returned {rc}", file=sys.stderr)
            return 2
    dst = ctypes.create_string_buffer(page * slots)
    src = ctypes.create_string_buffer(b"\x07" * page, page)
    dst_addr, src_addr = ctypes.addressof(dst), ctypes.addressof(src)
    if target.register_memory(dst_addr, page * slots) != 0:
        print("target register_memory failed", file=sys.stderr)
        return 2
    if initiator.register_memory(src_addr, page) != 0:
        print("initiator register_memory failed", file=sys.stderr)
        return 2
    peer = f"127.0.0.1:{target.get_rpc_port()}"

    def write(first: int, n: int) -> None:
        dsts = [dst_addr + ((first + k) % slots) * page for k in range(n)]
        rc = initiator.batch_transfer_sync_write(peer, [src_addr] * n, dsts, [page] * n)
        if rc != 0:
            raise RuntimeError(f"batch_transfer_sync_write returned {rc}")

    write(0, min(batch, pages))  # warm-up: handshake and connection
    for _ in range(reps):
        t0 = time.perf_counter()
        sent = 0
        while sent < pages:
            n = min(batch, pages - sent)
            write(sent, n)
            sent += n
        elapsed = time.perf_counter() - t0
        print(f"gbps={page * pages / max(elapsed, 1e-9) / 1e9:.6f}", flush=True)
    landed = dst.raw[: page * min(slots, pages)]
    if landed.count(b"\x07") != len(landed):
        print("destination pages do not hold the written bytes", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
