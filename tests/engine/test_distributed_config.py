"""The multi-node flags become a validated DistributedConfig; inconsistent ones are usage errors naming the flag."""

from __future__ import annotations

import pytest

from shoal.engine import cli
from shoal.engine.config import DistributedConfig, EngineConfig


def _usage_error(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["serve", *argv])
    assert exit_.value.code == 2
    return capsys.readouterr().err


def test_flags_fill_the_distributed_config():
    args = cli.build_parser().parse_args(
        ["serve", "--model", "/m", "-tp", "2", "-pp", "2", "--nnodes", "2", "--master-addr", "10.0.0.1",
         "--master-port", "29555", "--distributed-timeout", "7", "--heartbeat-timeout", "3",
         "--pipeline-micro-batches", "4", "--pipeline-layer-partition", "5,3"])
    d = cli.engine_config_from_args(args).distributed
    assert (d.nnodes, d.node_rank, d.master_addr, d.master_port) == (2, 0, "10.0.0.1", 29555)
    assert (d.collective_timeout, d.heartbeat_timeout, d.micro_batches, d.layer_partition) == (7, 3, 4, [5, 3])
    assert d.startup_timeout == DistributedConfig().startup_timeout  # unset: the default
    # workers receive it as JSON on their command line
    assert DistributedConfig.model_validate_json(d.model_dump_json()) == d


@pytest.mark.parametrize("argv,message", [
    (["--nnodes", "2", "--node-rank", "1"], "pass --headless"),
    (["--nnodes", "2", "--node-rank", "2", "--headless"], "--node-rank"),
    (["--headless"], "--headless is for nodes other than 0"),
    (["--model", "/m", "-pp", "2", "--pipeline-layer-partition", "3,1,1"], "one layer count per pipeline stage"),
    (["--model", "/m", "-tp", "3", "--nnodes", "2"], "not divisible by nnodes 2"),
    (["--model", "/m", "--pipeline-micro-batches", "0"], "--pipeline-micro-batches"),
])
def test_inconsistent_flags_are_usage_errors(capsys, argv, message):
    assert message in _usage_error(capsys, *argv)


def test_offline_llm_takes_the_distributed_options_as_a_dict():
    c = EngineConfig(model="/m", pipeline_parallel_size=2, distributed={"micro_batches": 3})
    assert c.distributed.micro_batches == 3 and not c.distributed.exit_on_failure
    with pytest.raises(ValueError, match="layer_partition"):
        EngineConfig(model="/m", pipeline_parallel_size=2, distributed={"layer_partition": [0, 4]})
