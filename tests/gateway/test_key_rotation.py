"""Key rotation without an outage, through real processes: a `shoal-engine serve --api-key-file` and a per-service
`shoal-gateway --api-key-file` read a key file the way a mounted Secret is (one key per line, rewritten in place);
during a rollover both keys work, after it the old one is refused — and neither process restarted."""

from __future__ import annotations

import openai
import pytest

from .gwkit import Proc, engine_cmd, wait_for

pytestmark = pytest.mark.slow


def answers(url: str, key: str) -> int:
    client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)
    try:
        client.completions.create(model="tiny", prompt="hello", max_tokens=1)
        return 200
    except openai.APIStatusError as e:
        return e.status_code
    except openai.APIConnectionError:  # a timeout: the first requests may build the engine's kernels
        return 0


def test_engine_and_gateway_take_a_rotated_key_without_a_restart(fleet_model, start_gateway, tmp_path):
    engine_keys, gateway_keys = tmp_path / "engine-keys", tmp_path / "gateway-keys"
    for f in (engine_keys, gateway_keys):
        f.write_text("old-key\n")
    engine = Proc([*engine_cmd(fleet_model), "--api-key-file", str(engine_keys)])
    try:
        engine.wait_ready()
        # an engine's first requests may build its CPU kernels (minutes on a loaded machine)
        wait_for(lambda: answers(engine.url, "old-key") == 200, 900, "the engine's first answer")
        gateway = start_gateway(engine.url, extra=("--api-key-file", str(gateway_keys)))
        pids = engine.proc.pid, gateway.proc.pid
        assert answers(gateway.url, "old-key") == 200 and answers(gateway.url, "new-key") == 401
        for f in (engine_keys, gateway_keys):  # the rollover: the new key first, the old one still listed
            f.write_text("new-key\nold-key\n")
        wait_for(lambda: answers(gateway.url, "new-key") == 200, 30, "the new key to be accepted")
        assert answers(gateway.url, "old-key") == 200 and answers(engine.url, "new-key") == 200
        for f in (engine_keys, gateway_keys):  # every client moved: the old key goes
            f.write_text("new-key\n")
        wait_for(lambda: answers(gateway.url, "old-key") == 401 and answers(engine.url, "old-key") == 401, 30,
                 "the old key to be refused by the gateway and the engine")
        assert answers(gateway.url, "new-key") == 200
        assert (engine.proc.pid, gateway.proc.pid) == pids and engine.proc.poll() is None
    finally:
        engine.stop()
