"""A worker rank's loop without processes: rank 0's calls (wire.py) run the Worker method of the same name, until
`shutdown`; a name a Worker does not have (or a private one) is refused with a clear error."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import shoal.engine.distributed.worker as worker_module
from shoal.engine.distributed.comm import DistributedError
from shoal.engine.distributed.wire import decode_call, encode_call
from shoal.engine.distributed.worker import Worker


def fake_rank(monkeypatch, calls):
    """A Worker whose calls come from `calls` (each through the real encoding) and whose shard records what ran."""
    ran: list = []
    pending = iter([decode_call(encode_call(method, args)) for method, args in calls])
    monkeypatch.setattr(worker_module, "receive_call", lambda group: next(pending))
    monkeypatch.setattr(worker_module.dist, "monitored_barrier", lambda group, timeout: ran.append("barrier"))
    runner = SimpleNamespace(allocate_kv_cache=lambda blocks, size, state_slots=1: ran.append(("allocate", blocks, size)))
    shard = SimpleNamespace(runner=runner, sampler=None,
                            run_step=lambda inputs, started: ran.append(("step", inputs.tolist(), started > 0)))
    group = SimpleNamespace(control=None, monitor=SimpleNamespace(stop=lambda: ran.append("monitor stopped")))
    return Worker(group, shard), ran


def test_calls_run_the_method_of_the_same_name_until_shutdown(monkeypatch):
    worker, ran = fake_rank(monkeypatch, [("allocate_kv_cache", (64, 16)), ("execute_model", (torch.arange(3), None)),
                                          ("shutdown", ()), ("allocate_kv_cache", (1, 1))])
    worker.serve()
    assert ran == [("allocate", 64, 16), ("step", [0, 1, 2], True), "monitor stopped", "barrier"]


@pytest.mark.parametrize("method", ["warp_drive", "_call", "__init__"])
def test_a_method_a_worker_does_not_offer_is_refused(monkeypatch, method):
    worker, ran = fake_rank(monkeypatch, [(method, ())])
    with pytest.raises(DistributedError, match=f"rank 0 called '{method}', which a Worker does not have"):
        worker.serve()
    assert ran == []
