"""The model cache (operator/podtools/modelcache.py) and `shoal-podtools download` / `cache-lease` on it: one
download per model+revision however many pods start at once, verified against the hub's checksums, never a partial
entry, a corrupt entry fetched again, LRU eviction under the size cap that never takes a leased entry."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from hubkit import FakeHub
from shoal.operator.podtools import modelcache
from shoal.operator.podtools.modelcache import LAST_USED, CacheError, ModelCache, entry_key


def _download(cache: Path, hub: FakeHub, *extra: str, holder: str = "pod-a") -> subprocess.Popen:
    env = {**os.environ, "HF_HOME": str(cache / "hf"), "SHOAL_CACHE": str(cache), "HF_ENDPOINT": hub.url,
           "HOSTNAME": holder}
    env.pop("HF_HUB_OFFLINE", None)
    return subprocess.Popen([sys.executable, "-m", "shoal.operator.podtools", "download", "--model", "org/m",
                             "--retry-backoff", "0.05", "--max-retries", "1",
                             "--termination-log", str(cache / f"termination-{holder}"), *extra],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/")


def _finish(proc: subprocess.Popen) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=120)
    return proc.returncode, out, err


@pytest.fixture
def model(tmp_path) -> Path:
    folder = tmp_path / "published"
    folder.mkdir()
    (folder / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (folder / "model-00001-of-00002.safetensors").write_bytes(os.urandom(300_000))
    (folder / "model-00002-of-00002.safetensors").write_bytes(os.urandom(200_000))
    return folder


@pytest.fixture
def hub(model):
    with FakeHub() as hub:
        hub.publish("org/m", model)
        yield hub


def test_pods_starting_together_download_once(tmp_path, hub, model):
    cache = tmp_path / "cache"
    procs = [_download(cache, hub, holder=f"pod-{i}") for i in range(3)]
    results = [_finish(p) for p in procs]
    assert all(rc == 0 for rc, _, _ in results), results
    assert hub.file_downloads("org/m") == 3, f"each of the 3 files once: {hub.downloads}"
    outs = "".join(out for _, out, _ in results)
    assert outs.count("downloaded: 'org/m'") == 1 and outs.count("found in the cache (verified)") == 2
    entry = cache / "models" / entry_key("org/m", None)
    for f in model.iterdir():
        assert (entry / f.name).read_bytes() == f.read_bytes()
    summaries = [json.loads((cache / f"termination-pod-{i}").read_text())["modelCache"] for i in range(3)]
    assert sorted(s["fetched"] for s in summaries) == [False, False, True]
    assert {s["entry"] for s in summaries} == {"org--m@main"} and summaries[0]["verified"] == "hub"
    assert summaries[0]["sizeBytes"] == 500_000 + len((model / "config.json").read_bytes())
    assert sorted(os.listdir(cache / "models" / ".leases" / "org--m@main")) == ["pod-0", "pod-1", "pod-2"]


def test_a_corrupt_entry_is_detected_at_start_and_fetched_again(tmp_path, hub, model):
    cache = tmp_path / "cache"
    assert _finish(_download(cache, hub))[0] == 0
    shard = cache / "models" / "org--m@main" / "model-00002-of-00002.safetensors"
    data = bytearray(shard.read_bytes())
    data[1000] ^= 1  # same size, one bit flipped: only the sha256 sees it
    shard.write_bytes(bytes(data))
    rc, out, _ = _finish(_download(cache, hub, holder="pod-b"))
    assert rc == 0 and "is corrupt (model-00002-of-00002.safetensors: sha256" in out and "downloaded:" in out
    assert shard.read_bytes() == (model / shard.name).read_bytes()
    assert hub.file_downloads("org/m") == 6


def test_the_start_check_hashes_only_the_files_changed_since_the_commit(tmp_path, hub, monkeypatch):
    """`--verify stat` (the default): an untouched entry is checked without reading a byte; a file rewritten since
    the commit (a new mtime) is hashed and its corruption found. A change that kept size and mtime is what only
    `full` sees."""
    cache = tmp_path / "cache"
    assert _finish(_download(cache, hub))[0] == 0
    entries, key = ModelCache(cache / "models"), "org--m@main"
    hashed: list[str] = []
    real = modelcache.file_sha256
    monkeypatch.setattr(modelcache, "file_sha256", lambda path: hashed.append(path.name) or real(path))
    assert entries.verify(key, "stat") == [] and hashed == []
    shard = cache / "models" / key / "model-00002-of-00002.safetensors"
    before = shard.stat()
    data = bytearray(shard.read_bytes())
    data[7] ^= 1
    shard.write_bytes(bytes(data))
    os.utime(shard, ns=(before.st_atime_ns, before.st_mtime_ns))  # size and mtime as committed
    assert entries.verify(key, "stat") == [] and hashed == []
    assert "model-00002-of-00002.safetensors: sha256" in entries.verify(key, "full")[0]
    hashed.clear()
    os.utime(shard)  # rewritten now
    assert "model-00002-of-00002.safetensors: sha256" in entries.verify(key, "stat")[0]
    assert hashed == [shard.name]
    with pytest.raises(ValueError, match="verify mode 'quick'"):
        entries.verify(key, "quick")


def test_a_bad_transfer_never_becomes_an_entry(tmp_path, hub):
    cache = tmp_path / "cache"
    hub.corrupt.add(("org/m", "model-00001-of-00002.safetensors"))
    rc, _, err = _finish(_download(cache, hub))
    assert rc == 1 and "does not match the hub's checksums: model-00001-of-00002.safetensors" in err
    assert "Traceback" not in err
    assert not (cache / "models" / "org--m@main").exists()
    assert "checksums" in (cache / "termination-pod-a").read_text()  # the operator shows it as a condition
    hub.corrupt.clear()
    assert _finish(_download(cache, hub))[0] == 0  # the next attempt starts over and succeeds


def test_a_model_larger_than_the_cap_fails_with_the_sizes(tmp_path, hub):
    cache = tmp_path / "cache"
    rc, _, err = _finish(_download(cache, hub, "--max-cache-bytes", "100000"))
    assert rc == 1 and "needs 0.48 MiB but the model cache holds at most 0.10 MiB" in err
    assert "raise spec.model.cache.size" in err and not (cache / "models" / "org--m@main").exists()


def test_a_llama_cpp_repository_brings_its_one_gguf_file_and_several_are_refused(tmp_path):
    """A repository without config.json is llama.cpp's: its GGUF file is the model (the engine serves a folder
    holding one); with several quantizations in it, fetching them all would be a mistake, so it says which."""
    repo = tmp_path / "gguf-repo"
    repo.mkdir()
    (repo / "model-Q4_1.gguf").write_bytes(b"GGUF" + os.urandom(50_000))
    (repo / "README.md").write_text("# GGUF\n")
    cache = tmp_path / "cache"
    with FakeHub() as hub:
        hub.publish("org/m", repo)
        rc, out, err = _finish(_download(cache, hub))
        assert rc == 0, err
        entry = cache / "models" / "org--m@main"
        assert (entry / "model-Q4_1.gguf").read_bytes() == (repo / "model-Q4_1.gguf").read_bytes()
        assert not (entry / "README.md").exists()
        (repo / "model-Q8_0.gguf").write_bytes(b"GGUF" + os.urandom(1000))
        hub.publish("org/m", repo, commit="d" * 40)
        rc, out, err = _finish(_download(tmp_path / "cache2", hub))
    assert rc == 1 and "no config.json and 2 GGUF files (model-Q4_1.gguf, model-Q8_0.gguf)" in err
    assert "Traceback" not in err and not (tmp_path / "cache2" / "models" / "org--m@main").exists()


# ---- the cache itself, without a hub ---------------------------------------------------------------------------
def _entry(cache: ModelCache, key: str, size: int, last_used: float) -> None:
    partial = cache.partial(key)
    partial.mkdir(parents=True)
    (partial / "model.safetensors").write_bytes(b"x" * size)
    cache.commit(key, {"source": key}, {"model.safetensors": None})
    os.utime(cache.path(key) / LAST_USED, (last_used, last_used))


def test_a_partial_download_is_never_an_entry(tmp_path):
    cache = ModelCache(tmp_path)
    cache.partial("k").mkdir()
    (cache.partial("k") / "model.safetensors").write_bytes(b"half")
    (tmp_path / "orphan").mkdir()  # a folder without a manifest (a crash before the rename cannot leave one)
    assert cache.manifest("k") is None and cache.entries() == []
    cache.commit("k", {"source": "k"}, {"model.safetensors": None})
    assert not cache.partial("k").exists()
    assert [e.key for e in cache.entries()] == ["k"] and cache.verify("k") == []
    assert cache.manifest("k")["verified"] == "manifest"  # no hub checksum: the manifest is the reference


def test_a_second_pod_waits_for_the_lock(tmp_path):
    cache = ModelCache(tmp_path)
    waited, order = threading.Event(), []
    with cache.lock("k"):
        t = threading.Thread(target=lambda: cache.lock("k", on_wait=waited.set).__enter__() or order.append("b"))
        t.start()
        assert waited.wait(10), "waited for the second locker to find the lock taken"
        order.append("a")
    t.join(10)
    assert order == ["a", "b"]


def test_eviction_is_lru_and_skips_leased_entries(tmp_path):
    now = [10_000.0]
    cache = ModelCache(tmp_path, lease_ttl=600, clock=lambda: now[0])
    _entry(cache, "old", 400, last_used=1_000)
    _entry(cache, "older-but-leased", 400, last_used=500)
    _entry(cache, "recent", 400, last_used=5_000)
    cache.lease("older-but-leased", "pod-x")
    assert cache.make_room("new", 500, cap=1_500) == ["old"]  # 1200 used: one LRU unleased entry frees enough
    assert {e.key for e in cache.entries()} == {"older-but-leased", "recent"}
    with pytest.raises(CacheError, match=r"in use: older-but-leased .*leased by pod-x"):
        cache.make_room("big", 1_200, cap=1_500)  # the reservation of "new" and the leased entry stay
    assert {e.key for e in cache.entries()} == {"older-but-leased", "recent"}, "nothing evicted on a refusal"
    now[0] += 601  # pod-x died without releasing: its lease expires
    cache.unreserve("new")
    assert cache.make_room("big", 1_200, cap=1_500) == ["older-but-leased", "recent"]


def test_the_lease_sidecar_refreshes_and_releases(tmp_path):
    from argparse import Namespace

    from shoal.operator.podtools import lease

    stop = threading.Event()
    args = Namespace(model="org/m", revision="v1", cache_dir=str(tmp_path), holder="pod-a")
    t = threading.Thread(target=lease.run, args=(args, stop))
    t.start()
    leases = tmp_path / ".leases" / entry_key("org/m", "v1")
    deadline = time.monotonic() + 10
    while not (leases / "pod-a").exists():
        assert time.monotonic() < deadline, "waited for the sidecar's lease"
        time.sleep(0.02)
    assert ModelCache(tmp_path).leases(entry_key("org/m", "v1")) == ["pod-a"]
    stop.set()
    t.join(10)
    assert not (leases / "pod-a").exists()


def test_the_adapter_sidecar_counts_the_model_cache_against_its_cap(tmp_path, monkeypatch):
    """A pod's own cache holds the model (in the model cache) and the adapters (in the hub cache): the adapter
    sidecar's cap counts both, or adapters could fill the volume past its size limit."""
    from huggingface_hub import constants

    from shoal.operator.podtools import adapter_sync

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("SHOAL_CACHE", str(tmp_path / "shoal"))
    cache = ModelCache(tmp_path / "shoal" / "models")
    _entry(cache, "org--m@main", 4000, last_used=1.0)
    assert adapter_sync.cache_usage() >= 4000


def test_an_abandoned_download_is_cleared_when_space_is_short_but_a_running_one_is_kept(tmp_path):
    cache = ModelCache(tmp_path)
    for key in ("abandoned", "running"):
        cache.partial(key).mkdir()
        (cache.partial(key) / "model.safetensors").write_bytes(b"x" * 600)
    assert cache.usage() == 1200  # both count against the cap while they are there
    with cache.lock("running"):  # its downloader holds the entry's lock
        cache.make_room("new", 600, cap=1_300)
    assert not cache.partial("abandoned").exists() and cache.partial("running").exists()


def test_the_download_reports_what_the_whole_cache_holds(tmp_path, hub):
    cache = tmp_path / "cache"
    other = ModelCache(cache / "models")
    _entry(other, "org--old@main", 1_000, last_used=1_000)
    other.lease("org--old@main", "pod-x")
    assert _finish(_download(cache, hub, "--max-cache-bytes", "10000000"))[0] == 0
    summary = json.loads((cache / "termination-pod-a").read_text())["modelCache"]
    inventory = summary["cache"]
    assert inventory["entries"] == 2 and inventory["capBytes"] == 10_000_000
    assert inventory["usedBytes"] == summary["sizeBytes"] + 1_000
    newest, old = inventory["recent"]  # the most recently used first
    assert newest == {"entry": "org--m@main", "sizeBytes": summary["sizeBytes"], "leases": 1,
                      "lastUsed": newest["lastUsed"]} and newest["lastUsed"].endswith("Z")
    assert old == {"entry": "org--old@main", "sizeBytes": 1_000, "leases": 1, "lastUsed": "1970-01-01T00:16:40Z"}


def test_the_summary_always_fits_the_termination_message_whole():
    from shoal.operator.podtools.download import MESSAGE_LIMIT, summary_message

    recent = [{"entry": f"org--{'m' * 400}{i}@main", "sizeBytes": i, "leases": 0, "lastUsed": "2026-01-01T00:00:00Z"}
              for i in range(10)]
    summary = {"entry": recent[0]["entry"], "sizeBytes": 1, "cache": {"entries": 10, "usedBytes": 45,
                                                                       "recent": recent}}
    text = summary_message(summary)
    assert len(text) <= MESSAGE_LIMIT
    shown = json.loads(text)["modelCache"]
    assert 0 < len(shown["cache"]["recent"]) < 10 and shown["cache"]["recent"] == recent[:len(shown["cache"]["recent"])]
    assert shown["cache"]["entries"] == 10 and len(summary["cache"]["recent"]) == 10  # the caller's list is kept
