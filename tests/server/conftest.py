"""Server fixtures: the real `shoal-engine serve` process on a free localhost port, driven over HTTP."""

from __future__ import annotations

import json
import signal
import sys

import pytest
from promkit import metric  # noqa: F401  (re-exported: tests import metric from here)
from prockit import LoggedProcess, free_port, http


class ServerProcess(LoggedProcess):
    """`python -m shoal.engine.cli serve ...` as a child process; logs go to a temporary file."""

    def __init__(self, model_dir, *args: str, env: dict | None = None, served_name: str = "tiny"):
        port = free_port()
        cmd = [sys.executable, "-m", "shoal.engine.cli", "serve", "--model", str(model_dir),
               "--served-model-name", served_name, "--host", "127.0.0.1", "--port", str(port), *args]
        super().__init__(cmd, port, env, log_prefix="shoal-serve-")
        self.base = self.url
        self.model = served_name

    def request(self, method: str, path: str, body: bytes | dict | None = None, headers: dict | None = None,
                timeout: float = 30.0) -> tuple[int, bytes, dict]:
        return http(method, self.base + path, body, headers, timeout)

    def post(self, path: str, body, **kw) -> tuple[int, dict, dict]:
        status, raw, headers = self.request("POST", path, body, **kw)
        try:
            parsed = json.loads(raw) if raw else None
        except ValueError:
            parsed = raw
        return status, parsed, headers


@pytest.fixture(scope="module")
def start_server():
    """start(model_dir, *flags, env=...) -> a ready ServerProcess, stopped at the end of the module."""
    servers: list[ServerProcess] = []

    def start(model_dir, *args, env=None, wait=True, **kw) -> ServerProcess:
        s = ServerProcess(model_dir, *args, env=env, **kw)
        servers.append(s)
        return s.wait_ready() if wait else s

    yield start
    for s in servers:
        s.stop(signal.SIGTERM, timeout=15)


def offline_greedy(model_dir, prompts: list[str], max_tokens: int, **engine_kw) -> list[str]:
    """The offline engine's greedy texts (EOS ignored): what a server given the same model must answer."""
    from shoal.engine import LLM, SamplingParams

    with LLM(model=model_dir, **engine_kw) as llm:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        return [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]


def assert_served_greedy(client, prompts: list[str], want: list[str], max_tokens: int) -> None:
    """Each prompt's greedy completion from the server (an openai client), streamed and not, is the text wanted."""
    extra = {"ignore_eos": True}
    for prompt, text in zip(prompts, want, strict=True):
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                      extra_body=extra)
        assert r.choices[0].text == text
        stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                           stream=True, extra_body=extra)
        assert "".join(c.choices[0].text for c in stream if c.choices) == text
