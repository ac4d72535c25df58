"""How rank 0 calls a method on every other rank: one pickled (method name, arguments) message on the control group.

A call goes out as two broadcasts: its length in a one-element int64 tensor (so a worker can post its receive
before knowing anything about the call), then its bytes. The worker runs the method of that name on its Worker
(worker.py), so a new command is one method there and one `collective_rpc("name", ...)` in the driver.

Tensors in the arguments travel as numpy arrays: pickling a tensor the default way goes through torch.save, some
25x slower (about 4 ms for a 64-sequence decode plan against 0.15 ms), a cost every step would pay. The step needs
no fixed-size fast path of its own: encoding and decoding a decode step's call costs 15-45 us more than packing the
plan by hand into int64 fields did, and over gloo the two were indistinguishable (about 2 ms per step either way,
at 16 and 256 sequences, on the 2-core machine).
"""

from __future__ import annotations

import copyreg
import io
import pickle
from datetime import timedelta

import torch
import torch.distributed as dist

# After the shutdown call every rank confirms at a barrier before rank 0 closes the rendezvous store, so no worker
# can mistake the store going away for rank 0 dying.
SHUTDOWN_BARRIER_TIMEOUT = timedelta(seconds=30)


def _reduce_tensor(t: torch.Tensor):
    try:
        return torch.from_numpy, (t.detach().cpu().numpy(),)
    except TypeError:  # a dtype numpy lacks (bfloat16, fp8): the default way
        return t.__reduce_ex__(pickle.HIGHEST_PROTOCOL)


class _Pickler(pickle.Pickler):
    dispatch_table = copyreg.dispatch_table.copy()
    dispatch_table[torch.Tensor] = _reduce_tensor


def encode_call(method: str, args: tuple) -> bytes:
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump((method, args))
    return buffer.getvalue()


def decode_call(payload: bytes) -> tuple[str, tuple]:
    method, args = pickle.loads(payload)
    return method, args


def broadcast_call(group, method: str, args: tuple) -> None:
    """Rank 0: send `method(*args)` to every rank of `group`."""
    payload = encode_call(method, args)
    dist.broadcast(torch.tensor([len(payload)], dtype=torch.int64), src=0, group=group)
    dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), src=0, group=group)


def receive_call(group) -> tuple[str, tuple]:
    """A worker: wait for rank 0's next call; (method name, arguments)."""
    size = torch.empty(1, dtype=torch.int64)
    dist.broadcast(size, src=0, group=group)
    payload = torch.empty(int(size), dtype=torch.uint8)
    dist.broadcast(payload, src=0, group=group)
    return decode_call(payload.numpy().tobytes())
