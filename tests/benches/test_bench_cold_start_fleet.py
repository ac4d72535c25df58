"""The fleet cold-start benchmark's pure parts (its figures from its marks, its table, the answers' comparison), so
the benchmark, which no suite runs, cannot rot unseen."""

from benches.bench_cold_start_fleet import (DOWNLOAD, SCENARIOS, answers_match, line, wake_breakdown,
                                            zero_breakdown)


def test_a_start_from_zero_breaks_down_into_its_marks():
    events = [(12.0, f"init {DOWNLOAD} started"), (15.0, f"init {DOWNLOAD} exited 0"), (15.5, "started"),
              (21.0, "ready")]
    startup = {"process": 0.1, "imports": 3.0, "weights": 2.0, "kv_cache": 0.0, "other": 0.4, "total": 5.5}
    r = zero_breakdown(t0=10.0, decided=10.5, events=events, startup=startup, first=21.5)
    assert r == {"decision": 0.5, "pod": 2.0, "download": 3.0, "engine": 5.5,
                 "phases": {"process": 0.1, "imports": 3.0, "weights": 2.0, "other": 0.4},  # kv_cache 0: not shown
                 "first": 0.5, "total": 11.5}
    assert line("fetch", r) == ("fetch   total  11.50s to the first token = decision 0.50s, pod 2.00s, download 3.00s, "
                                "engine 5.50s (process 0.10s, imports 3.00s, weights 2.00s, other 0.40s), first 0.50s")
    no_init = zero_breakdown(10.0, 10.5, [(11.0, "started"), (12.0, "ready")], {"total": 1.0}, 13.5)
    assert no_init["pod"] == 0.5 and no_init["download"] == 0.0 and no_init["first"] == 1.5


def test_the_lines_and_the_answers_comparison():
    r = wake_breakdown(t0=1.0, woke=1.25, first=1.5)
    assert line("sleep1", r, "asleep") == "sleep1  total   0.50s to the first token = wake 0.25s, first 0.25s  [asleep]"
    assert set(SCENARIOS) == {"fetch", "cache", "file", "sleep1", "sleep2"}
    same = {"fetch": "a", "cache": "a", "file": "a", "sleep1": "a", "sleep1:before": "a", "sleep2": "a"}
    assert answers_match(same) == {"model": True}
    assert answers_match({**same, "sleep2": "c"}) == {"model": False}
