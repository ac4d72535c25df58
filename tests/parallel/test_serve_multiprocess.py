"""`shoal-engine serve` as several processes: the multi-node flags (ranks started 10 s apart), and failure of a
rank mid-generation."""

from __future__ import annotations

import os
import re
import signal
import time

import openai
import pytest

from serving import Served, all_gone, free_port
from shoal.engine import LLM, SamplingParams

pytestmark = pytest.mark.slow

COMMON = ["--block-size", "4", "--max-model-len", "512", "--num-kv-blocks", "256", "--served-model-name", "tiny",
          "--log-level", "info"]
# The documented bound on detecting a dead rank: heartbeat timeout 10 s + 2 polls, plus rank 0's 2 s exit grace;
# a connection reset is usually seen at once. A little slack for a loaded 2-core machine.
FAILURE_BOUND_S = 25.0


def test_multinode_flags_staggered_start_serve_through_rank0(llama_kv1, tmp_path):
    master, http0, http1 = free_port(), free_port(), free_port()
    dist = ["--tensor-parallel-size", "2", "--pipeline-parallel-size", "2", "--nnodes", "2",
            "--master-addr", "127.0.0.1", "--master-port", str(master)]
    node0 = Served(["--model", str(llama_kv1), *COMMON, *dist, "--node-rank", "0", "--pipeline-layer-partition", "3,1",
                    "--pipeline-micro-batches", "3"], tmp_path / "node0.log", http0)
    node1 = None
    try:
        time.sleep(10)  # node 1 comes up 10 s later: node 0 waits for it and says who is missing
        assert node0.get("/readyz") != 200
        node1 = Served([*dist, "--node-rank", "1", "--headless"], tmp_path / "node1.log", http1)
        node0.wait_status("/readyz", 200, timeout=120)
        node1.wait_status("/readyz", 200, timeout=30)
        assert "waiting for ranks [2, 3] of 4 to join" in node0.text()
        assert "3 micro-batches per step" in node0.text()
        assert "[rank 3 (pp stage 1/2, tp 1/2)] shard loaded (layers 3-3)" in node1.text()  # partition 3,1
        assert node1.get("/v1/models") == 404  # workers serve health only

        client = openai.OpenAI(base_url=f"http://127.0.0.1:{http0}/v1", api_key="none")
        prompt = "Once upon a time there was a little shoal"
        got = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert got.usage.completion_tokens == 12
        # Grammar bitmasks and prompt-scoring rows travel to the last stage's sampler with the step's rows.
        choice = client.completions.create(model="tiny", prompt=prompt, max_tokens=20, n=2, seed=1,
                                           extra_body={"guided_choice": ["yes", "no"]})
        assert all(c.text in ("yes", "no") and c.finish_reason == "stop" for c in choice.choices)
        echo = client.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=0)
        with LLM(model=llama_kv1, block_size=4, max_model_len=512) as llm:
            want = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
            scored = llm.generate([prompt], SamplingParams(max_tokens=0, prompt_logprobs=0))[0]
        assert got.choices[0].text == want[0].outputs[0].text
        want_lp = [d[t].logprob for d, t in zip(scored.prompt_logprobs[1:], scored.prompt_token_ids[1:])]
        assert echo.choices[0].logprobs.token_logprobs[1:] == pytest.approx(want_lp, abs=1e-3)
        # Metrics say which rank and stage each process is.
        import urllib.request

        def scrape(port):
            return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()

        assert 'shoal:parallel_info{model_name="tiny",pp_size="2",rank="0",tp_size="2"} 1.0' in scrape(http0)
        from prometheus_client.parser import text_string_to_metric_families

        ranks = {(s.labels["rank"], s.labels["pp_rank"], s.labels["tp_rank"], s.labels["node_rank"]): s.value
                 for family in text_string_to_metric_families(scrape(http1)) for s in family.samples
                 if s.name == "shoal:worker_rank_info"}
        assert ranks == {("2", "1", "0", "1"): 1.0, ("3", "1", "1", "1"): 1.0}

        # Drain: SIGTERM reaches every process of the group at once (as when both pods are deleted) in the middle
        # of a stream. Every rank serves on while rank 0 finishes the stream, then rank 0 stops the group and
        # every process exits 0.
        stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=100, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        chunks = iter(stream)
        text = next(chunks).choices[0].text
        processes = {node: _group_pids(node.proc.pid) for node in (node0, node1)}
        assert [len(pids) for pids in processes.values()] == [2, 3]  # rank 0 + rank 1; headless + ranks 2, 3
        for node in (node0, node1):
            os.killpg(node.proc.pid, signal.SIGTERM)
        reasons = []
        for chunk in chunks:
            text += chunk.choices[0].text
            reasons += [chunk.choices[0].finish_reason] if chunk.choices[0].finish_reason else []
        assert reasons == ["length"]
        with LLM(model=llama_kv1, block_size=4, max_model_len=512) as llm:
            want = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
        assert text == want[0].outputs[0].text  # every token, none lost to a rank that stopped early
        assert node0.proc.wait(60) == 0
        assert node1.proc.wait(60) == 0
        assert "local worker rank 1 exited with code 0" in node0.text()
        assert "node 1: all workers stopped" in node1.text()
        for node, name in ((node0, "rank 1 "), (node1, "rank 2 "), (node1, "rank 3 ")):
            assert re.search(rf"\[{name}[^\]]*\] received SIGTERM: serving on", node.text()), name
    finally:
        node0.stop()
        if node1 is not None:
            node1.stop()


def test_killing_a_worker_mid_generation_fails_liveness_and_stops_every_rank(llama_kv1, tmp_path):
    server = Served(["--model", str(llama_kv1), *COMMON, "--tensor-parallel-size", "2",
                     "--pipeline-parallel-size", "2"], tmp_path / "serve.log", free_port())
    try:
        server.wait_status("/readyz", 200, timeout=120)
        workers = server.worker_pids()
        assert len(workers) == 3
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="none", max_retries=0)
        stream = client.completions.create(model="tiny", prompt="Hello world", max_tokens=480, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        chunks = iter(stream)
        for _ in range(5):
            next(chunks)
        victim = workers[-1]  # rank 3: last pipeline stage, tensor-parallel rank 1
        os.kill(victim, signal.SIGKILL)
        killed_at = time.monotonic()
        livez_failed_at = server.wait_status("/livez", 503, timeout=FAILURE_BOUND_S)
        # The stream ends with the engine's error event, or with a cut connection once the server has exited (the
        # SDK raises APIConnectionError, an APIError): it neither hangs nor runs on to max_tokens, which would end
        # it without raising.
        with pytest.raises(openai.APIError) as failure:
            for _ in chunks:
                pass
        rest = str(failure.value)
        assert "engine" in rest or "Connection" in rest, rest
        assert server.proc.wait(FAILURE_BOUND_S) != 0
        exited_at = time.monotonic()
        assert livez_failed_at < exited_at
        assert exited_at - killed_at < FAILURE_BOUND_S
        assert all_gone(workers)
        log = server.text()
        for rank in (1, 2):  # the survivors noticed by themselves and exited 1
            assert f"local worker rank {rank} exited with code 1" in log, log[-4000:]
    finally:
        server.stop()


def test_a_hung_worker_is_noticed_by_heartbeat_while_idle(llama_kv1, tmp_path):
    """SIGSTOP (a hung rank: no connection is closed) while no request runs: only the heartbeat can tell."""
    server = Served(["--model", str(llama_kv1), *COMMON, "--tensor-parallel-size", "2", "--heartbeat-timeout", "3"],
                    tmp_path / "serve.log", free_port())
    try:
        server.wait_status("/readyz", 200, timeout=120)
        (worker,) = server.worker_pids()
        os.kill(worker, signal.SIGSTOP)
        stopped_at = time.monotonic()
        livez_failed_at = server.wait_status("/livez", 503, timeout=15)
        assert server.proc.wait(15) != 0
        assert livez_failed_at - stopped_at < 3 + 2 * 1 + 2  # heartbeat timeout + two polls + slack
        assert "sent no heartbeat" in server.text()
        assert all_gone([worker])
    finally:
        server.stop()


def test_sigterm_while_the_ranks_load_exits_0_and_leaves_no_worker(llama_kv1, tmp_path):
    # A tensor-parallel pod deleted while it starts: rank 0 must not leave its workers behind. The worker is
    # stopped as soon as it exists, so rank 0 is still waiting for it (loading) when the signal comes.
    server = Served(["--model", str(llama_kv1), *COMMON, "--tensor-parallel-size", "2"], tmp_path / "serve.log",
                    free_port())
    try:
        deadline = time.monotonic() + 60
        while not server.worker_pids() and time.monotonic() < deadline:
            time.sleep(0.05)
        (worker,) = server.worker_pids()
        os.kill(worker, signal.SIGSTOP)
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(20) == 0, server.text()[-3000:]
        assert "while the model was loading" in server.text()
        assert all_gone([worker])
    finally:
        server.stop()


def _group_pids(pgid: int) -> list[int]:
    """The live processes of a process group (a `serve` started in its own session and the workers it spawned)."""
    from pathlib import Path

    pids = []
    for proc in Path("/proc").iterdir():
        try:
            stat = (proc / "stat").read_text()
        except (OSError, ValueError):
            continue
        state, _ppid, group = stat.rsplit(")", 1)[1].split()[:3]
        if int(group) == pgid and state != "Z":
            pids.append(int(proc.name))
    return pids
