"""`shoal-engine bench latency` end to end on a tiny model, with a stand-in llama-bench that prints what the real
one does (`-o json`): rows, the interleaved runs of both engines, and the speculative rows."""

from __future__ import annotations

import json
import stat

from shoal.engine.cli import main

FAKE_LLAMA_BENCH = r"""#!/usr/bin/env python3
import json, os, sys
if "--help" in sys.argv:
    print("  -d, --n-depth <n>   (default: 0)")
    sys.exit(0)
a = sys.argv
p, n = int(a[a.index("-p") + 1]), int(a[a.index("-n") + 1])
with open(__file__ + ".calls", "a") as f:
    f.write(" ".join(a[1:]) + " |" + os.environ.get("GOMP_SPINCOUNT", "-") + os.environ.get("OMP_WAIT_POLICY", "-")
            + "\n")
rows = [dict(n_prompt=p, n_gen=0, n_depth=d, avg_ts=400.0 + d) for d in (0, p)]
rows += [dict(n_prompt=0, n_gen=n, n_depth=d, avg_ts=50.0 - d / 100) for d in (0, p)]
print(json.dumps(rows))
"""


def test_bench_latency_compares_with_llama_cpp_and_speculation(model_factory, tmp_path, capsys, monkeypatch):
    for var in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "SHOAL_SET_WAIT_POLICY"):  # unset now, and again afterwards
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)
    bench = tmp_path / "bin" / "llama-bench"
    bench.parent.mkdir()
    bench.write_text(FAKE_LLAMA_BENCH)
    bench.chmod(bench.stat().st_mode | stat.S_IEXEC)
    gguf = tmp_path / "model.gguf"  # only its path reaches llama-bench
    gguf.write_bytes(b"")
    model = model_factory("llama")
    rc = main(["bench", "latency", "--model", str(model), "--llama-cpp-model", str(gguf), "--llama-cpp-bin",
               str(bench.parent), "--prompt-len", "16", "--output-len", "6", "--repeat", "2", "--spec-batch", "1",
               "3", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    (row,) = out["rows"]
    assert len(row["shoal"]["decode_tok_s_runs"]) == 2 and row["shoal"]["decode_tok_s"] > 0
    # Prefill on an empty context, generation at a depth of the prompt's length; one repetition per run.
    assert row["llama_cpp"] == {"ttft_ms": 1e3 * 16 / 400.0, "decode_tok_s": 50.0 - 0.16,
                                "decode_tok_s_runs": [49.84, 49.84], "decode_at_depth": True}
    calls = (tmp_path / "bin" / "llama-bench.calls").read_text().splitlines()
    assert len(calls) == 2 and all("-r 1" in c and "-d 0,16" in c and f"-m {gguf}" in c for c in calls)
    # Shoal picks its own OpenMP wait (a bounded spin on idle CPUs, passive beside busy ones: cpu_budget.py);
    # llama.cpp runs with its users' default, none of Shoal's variables
    assert out["openmp_wait"] in ("GOMP_SPINCOUNT=10000 (Shoal's choice)", "OMP_WAIT_POLICY=passive (Shoal's choice)")
    assert all(c.endswith(" |--") for c in calls)
    runs = {(r["run"], r["batch"]) for r in out["speculative"]}
    assert runs == {("off", 1), ("speculative", 1), ("off", 3), ("speculative", 3)}


def test_bench_latency_skips_llama_cpp_saying_why(model_factory, capsys):
    rc = main(["bench", "latency", "--model", str(model_factory("llama")), "--prompt-len", "8", "--output-len", "4",
               "--repeat", "1", "--skip-speculative"])
    assert rc == 0
    assert "llama.cpp skipped: no --llama-cpp-bin given" in capsys.readouterr().out
