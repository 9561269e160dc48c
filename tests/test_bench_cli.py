"""``adaptive-eager bench``: argument errors, a tiny real run in fresh processes, the output
check, break-even and the table, as pure functions where they can be."""
import dataclasses
import importlib.util
import io
import json

import pytest
import torch

from adaptive_eager.benchmarks import report, results, runner, scenarios
from adaptive_eager.benchmarks.results import MISMATCH, NEVER, OK, SKIPPED, Row
from adaptive_eager.benchmarks.workloads import Workload
from adaptive_eager.runtime import allocator
from adaptive_eager.cli import main
from helpers import MECHANICS_ENV


# ---------------------------------------------------------------------- arguments

@pytest.mark.parametrize("arguments, accepted", [
    (["--workload", "nope"], "chain8, ln_gelu_residual"),
    (["--size", "huge"], "tiny, medium, large"),
    (["--modes", "eager,fast"], "eager, eager+malloc, adaptive, compile"),
    (["--iters", "0"], "at least 1"),
    (["--scenarios", "nope"], "tiny_chain, tiny_mlp"),
])
def test_bad_arguments_are_one_line_and_exit_2(arguments, accepted, capsys):
    assert main(["bench", *arguments]) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and accepted in captured.err
    assert captured.out == ""


def test_plot_without_matplotlib_is_one_line_and_exit_2(monkeypatch, capsys, tmp_path):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real_find_spec(name, *a))
    assert main(["bench", "--plot", str(tmp_path / "b.png")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "adaptive-eager[plot]" in err


def test_eager_always_runs_first_as_the_reference():
    plan = runner.make_plan(["chain8"], ["tiny"], "compile,adaptive", iters=3)
    assert plan.modes == ("eager", "compile", "adaptive")
    assert runner.make_plan().cases == runner.DEFAULT_CASES
    assert ("train_step", "medium") in runner.DEFAULT_CASES       # where it does not pay yet
    assert runner.make_plan(["chain8", "mlp"], ["tiny"]).cases == (("chain8", "tiny"),
                                                                   ("mlp", "tiny"))


# ---------------------------------------------------------------------- a real tiny run

def test_tiny_run_in_fresh_processes_writes_every_field(tmp_path, monkeypatch, capsys):
    # Make the adaptive child compile its tiny segment at once, so the check covers a kernel.
    for name, value in {**MECHANICS_ENV, "NEURON_ADAPTIVE_EAGER_HOT_THRESHOLD": "1"}.items():
        monkeypatch.setenv(name, value)
    out = tmp_path / "bench.json"
    assert main(["bench", "--workload", "chain8", "--size", "tiny", "--iters", "2",
                 "--modes", "eager,eager+malloc,adaptive", "--json", str(out)]) == 0
    captured = capsys.readouterr()
    assert "[1/3] chain8 tiny eager … " in captured.err
    assert "[2/3] chain8 tiny eager+malloc … " in captured.err
    assert "[3/3] chain8 tiny adaptive … " in captured.err
    payload = json.loads(out.read_text())
    assert set(payload["machine"]) >= {"cpu", "cores", "torch_threads", "torch", "python"}
    assert payload["failed"] is False and payload["iters"] == 2
    eager, tuned, adaptive = payload["results"]
    assert tuned["mode"] == "eager+malloc" and tuned["compiles"] == 0
    assert tuned["ratio_to_eager"] > 0 and tuned["paired_ratio"] is None
    for row in (eager, tuned, adaptive):
        assert set(row) == {f.name for f in dataclasses.fields(Row)}
        assert row["status"] == OK and row["median_ms"] > 0 and row["peak_mib"] > 0
        assert 0 < row["first_iter_s"] <= row["total_s"]
    assert eager["ratio_to_eager"] == 1.0 and eager["break_even"] is None
    assert eager["paired_ratio"] is None and adaptive["paired_ratio"] > 0
    assert adaptive["compiles"] >= 1 and adaptive["compile_s"] > 0
    assert adaptive["break_even"] == NEVER or adaptive["break_even"] >= 1
    assert "reference" in captured.out and "chain8" in captured.out


# ---------------------------------------------------------------------- timing steps

def _recording_mode(events: list):
    """A child's mode that records what the schedule does, in order."""
    import contextlib
    from adaptive_eager.benchmarks.child import _Mode

    @contextlib.contextmanager
    def outside():
        events.append("outside")
        yield
    return _Mode(call=lambda x: events.append(("call", x)), settle=lambda: None,
                 scope=contextlib.nullcontext, counts=lambda: (0, 0.0),
                 finish=lambda: events.append("finish"), outside=outside)


@pytest.mark.parametrize("fresh, expected", [
    # The same tensors every step: built once, one finish at the block's end.
    (False, ["outside"] + [("call", "x0")] * 20 + ["finish"]),
    # Fresh ones: built FRESH_INPUTS_AHEAD at a time, each chunk finished.
    (True, ["outside"] + [("call", f"x{i}") for i in range(16)] + ["finish", "outside"]
     + [("call", f"x{i}") for i in range(16, 20)] + ["finish"]),
])
def test_steps_are_timed_without_a_sync_each(fresh, expected):
    """A program does not call ae.sync() every step (~5 us, a control point): a block of steps
    ends with one, and inputs are built outside the runtime ahead of the steps."""
    from adaptive_eager.benchmarks import child
    from adaptive_eager.benchmarks.workloads import Case
    assert child.FRESH_INPUTS_AHEAD == 16
    events: list = []
    inputs = (lambda i: (f"x{i}",)) if fresh else (lambda i: ("x0",))
    case = Case(fn=None, inputs=inputs, fresh_inputs=fresh)
    times, _ = child._timed_steps(_recording_mode(events), case, range(20))
    assert events == expected
    assert len(times) == 20


def test_a_blocks_finish_is_counted_in_its_last_step(monkeypatch):
    from adaptive_eager.benchmarks import child
    from adaptive_eager.benchmarks.workloads import Case
    now = [0.0]
    monkeypatch.setattr(child.time, "perf_counter", lambda: now[0])
    mode = _recording_mode([])
    mode.call = lambda x: now.__setitem__(0, now[0] + 1.0)          # a step: 1 s
    mode.finish = lambda: now.__setitem__(0, now[0] + 5.0)          # the block's end: 5 s
    times, _ = child._timed_steps(mode, Case(fn=None, inputs=lambda i: ("x",)), range(3))
    assert times == [1.0, 1.0, 6.0]


# ---------------------------------------------------------------------- the output check

def test_compare_outputs_finds_a_wrong_value():
    expected = (torch.ones(4), torch.zeros(2))
    assert results.compare_outputs((torch.ones(4), torch.zeros(2) + 1e-6), expected,
                                   1e-4, 1e-4) is None
    wrong = (torch.ones(4), torch.tensor([0.0, 0.5]))
    message = results.compare_outputs(wrong, expected, 1e-4, 1e-4)
    assert message and "not close" in message and "\n" not in message


def _measurement(mode, cold, steady, wait=0.0, compiles=0, warmup_steps=0, warmup_s=0.0):
    return {"workload": "chain8", "size": "tiny", "mode": mode, "cold_step_s": cold,
            "compile_wait_s": wait, "warmup_steps": warmup_steps, "warmup_s": warmup_s,
            "steady_step_s": steady, "compiles": compiles, "compile_s": 0.0,
            "peak_mib": 100.0, "torch_threads": 2}


def _fake_children(tmp_path, wrong_mode=None, failing_mode=None):
    """A stand-in for run_child: eager's output is ones; ``wrong_mode`` writes twos."""
    def run_child(workload, size, mode, plan, directory, warmup=None):
        # eager picks the warm-up's length; every other mode gets the same
        assert warmup == (None if mode == "eager" else 7)
        if mode == failing_mode:
            return runner.ChildOutcome(None, "", "RuntimeError: boom", 1.0)
        path = tmp_path / f"{mode}.pt"
        torch.save(torch.full((4,), 2.0 if mode == wrong_mode else 1.0), path)
        measurement = _measurement(mode, [0.1] * 3, [0.1] * 3, warmup_steps=warmup or 7)
        return runner.ChildOutcome(measurement, str(path), "", 1.0)
    return run_child


def test_a_wrong_output_is_reported_loudly_and_exits_1(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(runner, "run_child", _fake_children(tmp_path, wrong_mode="compile"))
    out = tmp_path / "bench.json"
    assert main(["bench", "--workload", "chain8", "--size", "tiny", "--json", str(out)]) == 1
    captured = capsys.readouterr()
    assert "OUTPUT MISMATCH" in captured.err
    assert "MISMATCH: chain8 tiny compile: output differs from eager" in captured.out
    statuses = [row["status"] for row in json.loads(out.read_text())["results"]]
    assert statuses == [OK, OK, OK, MISMATCH]


def test_eager_with_malloc_thresholds_is_skipped_where_they_cannot_be_set(
        tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(runner, "run_child", _fake_children(tmp_path))
    monkeypatch.setattr(allocator, "why_left_alone", lambda: "malloc is not glibc's")
    out = tmp_path / "bench.json"
    assert main(["bench", "--workload", "chain8", "--size", "tiny", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert [(row["mode"], row["status"]) for row in rows] == [
        ("eager", OK), ("eager+malloc", SKIPPED), ("adaptive", OK), ("compile", OK)]
    assert "not run: malloc is not glibc's" in capsys.readouterr().err


def test_a_failed_eager_child_fails_the_rest_and_exits_1(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(runner, "run_child", _fake_children(tmp_path, failing_mode="eager"))
    assert main(["bench", "--workload", "chain8", "--size", "tiny"]) == 1
    out = capsys.readouterr().out
    assert "FAILED: chain8 tiny eager: RuntimeError: boom" in out
    assert out.count("FAILED") >= 3


def test_a_workload_whose_extra_is_missing_is_skipped_with_the_reason():
    workload = Workload("needs_x", "needs a module", lambda size, device: None, {"tiny": "-"},
                        requires="surely_not_an_installed_module")
    plan = runner.make_plan(["chain8"], ["tiny"], iters=1)
    progress = runner.Progress(len(plan.modes), io.StringIO())
    rows = runner.run_case(workload, "tiny", plan, progress, "/nonexistent")
    assert [row.status for row in rows] == [SKIPPED] * len(plan.modes)
    assert "surely_not_an_installed_module is not installed" in rows[0].detail
    assert not results.any_failure(rows)


# ---------------------------------------------------------------------- break-even

EAGER = _measurement("eager", cold=[1.0] * 4, steady=[1.0] * 3)


@pytest.mark.parametrize("cold, wait, steady, expected", [
    ([1.0] * 4, 5.0, [0.5], 15),            # even for 4 steps, 5 s behind, gains 0.5 s a step
    ([3.0, 0.5, 0.5, 0.5], 0.0, [0.5], 6),  # slow first step, catches up after the measured ones
    ([0.5, 2.0, 0.1, 0.1], 0.0, [0.5], 3),  # ahead at 1, behind at 2, ahead for good from 3
    ([0.5] * 4, 0.0, [0.5], 1),             # faster from the start
    ([0.5] * 4, 0.0, [0.99], NEVER),        # 1% faster: within noise
    ([0.5] * 4, 0.0, [1.5], NEVER),         # slower
])
def test_break_even(cold, wait, steady, expected):
    assert results.break_even(EAGER, _measurement("adaptive", cold, steady, wait)) == expected


@pytest.mark.parametrize("cold, warmup_s, expected", [
    ([2.0] * 4, 5.0, 4 + 10 + 15),    # 4 s behind, 3 s more in the warm-up: 7 / 0.5 + 1
    ([1.25] * 4, 0.5, 4 + 10),        # 1 s behind, ahead by the warm-up's end
    ([0.5] * 4, 5.0, 4 + 10 + 3),     # 2 s ahead, 1 s behind after the warm-up: 1 / 0.5 + 1
    ([0.5] * 4, 1.0, 1),              # ahead from the first step on
])
def test_break_even_counts_the_warm_up(cold, warmup_s, expected):
    """The warm-up's 10 steps took 2 s in eager; ``warmup_s`` in the other mode."""
    eager = _measurement("eager", [1.0] * 4, [1.0], warmup_steps=10, warmup_s=2.0)
    other = _measurement("adaptive", cold, [0.5], warmup_steps=10, warmup_s=warmup_s)
    assert results.break_even(eager, other) == expected


def test_break_even_is_where_cumulative_time_crosses():
    other = _measurement("adaptive", [2.0, 2.0, 2.0, 2.0], [0.25], wait=3.0)
    k = results.break_even(EAGER, other)
    def cumulative(m, steps, wait=0.0):
        return sum(m["cold_step_s"][:steps]) + (wait + (steps - 4) * m["steady_step_s"][0]
                                                if steps > 4 else 0.0)
    assert cumulative(other, k, 3.0) < cumulative(EAGER, k)
    assert cumulative(other, k - 1, 3.0) >= cumulative(EAGER, k - 1)


# ---------------------------------------------------------------------- the table

def _rows():
    eager = results.measured_row(EAGER, EAGER)
    fast = results.measured_row(_measurement("adaptive", [1.0] * 4, [0.25], 2.0, 1), EAGER)
    slow = results.measured_row(_measurement("compile", [9.0] + [1.0] * 3, [2.0], 0.0, 3), EAGER,
                                MISMATCH, "output differs from eager: Tensor-likes are not close!")
    return [eager, fast, slow, Row("hf_gpt2", "tiny", "eager", SKIPPED, "no transformers")]


def test_rows_carry_ratios_and_break_even():
    eager, fast, slow, _ = _rows()
    assert (eager.ratio_to_eager, eager.break_even) == (1.0, None)
    assert fast.ratio_to_eager == 0.25 and fast.break_even == 4 + 2 + 1
    assert slow.ratio_to_eager == 2.0 and slow.break_even == NEVER
    assert fast.total_s == 4.0 and slow.first_iter_s == 9.0


def test_the_paired_ratio_is_the_runtimes_median_step_over_plain_eagers():
    measurement = {"paired_eager_s": (2.0, 4.0, 100.0), "paired_adaptive_s": (1.0, 2.0, 3.0)}
    assert results.paired_ratio(measurement) == 0.5
    assert results.paired_ratio({"paired_eager_s": (), "paired_adaptive_s": ()}) is None
    eager, fast, _, _ = _rows()
    assert eager.paired_ratio is None and fast.paired_ratio is None   # (none measured)


def test_text_table_aligns_columns_and_lists_problems():
    info = {"cpu": "Test CPU", "cores": 2, "torch_threads": 2, "torch": "2.13.0",
            "python": "3.11.7", "os": "Linux"}
    lines = report.text_table(_rows(), info, iters=4).splitlines()
    assert lines[0].startswith("Test CPU, 2 cores, 2 torch threads; torch 2.13.0, Python 3.11.7")
    header, eager, fast, slow, skipped = lines[1:6]
    assert header.split()[:5] == ["workload", "size", "mode", "step", "ms"]
    assert eager.split()[-2:] == ["-", "reference"]
    assert fast.split()[3:5] == ["250", "0.25"] and fast.split()[-2:] == ["7", "ok"]
    assert slow.split()[-2:] == ["never", "MISMATCH"]
    assert skipped.split()[-1] == "skipped"
    # right-aligned numbers end where their header ends
    assert header.index("break-even") + len("break-even") == eager.rindex("-") + 1
    assert header.index("step ms") + len("step ms") == fast.index("250") + 3
    assert lines[6].startswith("MISMATCH: chain8 tiny compile: output differs from eager")
    assert lines[7] == "skipped: hf_gpt2 tiny eager: no transformers"
    assert "do not trust" in lines[8]


def test_markdown_table_has_a_row_per_result():
    table = report.markdown_table(_rows()).splitlines()
    assert len(table) == 2 + 4
    assert all(line.count("|") == len(report.COLUMNS) + 1 for line in table)
    assert table[4].endswith("| never | MISMATCH |")


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    info = {"cpu": "Test CPU", "cores": 2, "torch_threads": 2, "torch": "2.13.0",
            "python": "3.11.7", "os": "Linux"}
    report.plot(_rows(), info, str(tmp_path / "ratios.png"))
    assert (tmp_path / "ratios.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_markdown_page_names_its_command_and_machine():
    from adaptive_eager.benchmarks.command import command_line
    from adaptive_eager.cli import _parser
    options = _parser().parse_args(["bench", "--all", "--iters", "7", "--markdown", "B.md"])
    command = command_line(options)
    assert command == "adaptive-eager bench --all --iters 7 --markdown B.md"
    info = {"cpu": "Test CPU", "cores": 2, "torch_threads": 2, "torch": "2.13.0",
            "python": "3.11.7", "os": "Linux"}
    page = report.markdown(_rows(), info, command, iters=7)
    assert f"by `{command}`" in page and "Machine: Test CPU, 2 cores" in page
    assert report.markdown_table(_rows()) in page
    assert "- MISMATCH: chain8 tiny compile" in page


# ---------------------------------------------------------------------- scenarios and targets

def test_list_shows_every_scenario_with_its_targets(capsys):
    from adaptive_eager.benchmarks.scenario_child import MEASUREMENTS
    assert set(scenarios.SCENARIOS) == set(MEASUREMENTS)      # each has its measurement
    assert main(["bench", "--list"]) == 0
    out = capsys.readouterr().out
    assert "chain8" in out and "scenarios (--scenarios [NAME ...]):" in out
    for name in scenarios.SCENARIOS:
        assert name in out
    assert "ratio ≤ 1.1, compiles ≤ 8" in out and "speedup ≥ 4" in out


def test_targets_are_checked_against_the_numbers_measured():
    new_length = scenarios.SCENARIOS["new_length_every_step"]     # ratio ≤ 1.1, compiles ≤ 8
    within = scenarios.judge(new_length, {"eager_s": 1.0, "adaptive_s": 1.1, "compiles": 0})
    assert [check.met for check in within.checks] == [True, True] and not within.missed
    slow = scenarios.judge(new_length, {"eager_s": 1.0, "adaptive_s": 1.3, "compiles": 9})
    assert [str(check) for check in slow.missed] == ["ratio ≤ 1.1: 1.30 MISSED",
                                                     "compiles ≤ 8: 9 MISSED"]
    large = scenarios.SCENARIOS["large_chain8"]                   # speedup ≥ 4
    assert not scenarios.judge(large, {"eager_s": 1.0, "adaptive_s": 0.2}).missed
    assert scenarios.judge(large, {"eager_s": 1.0, "adaptive_s": 0.5}).missed
    with pytest.raises(ValueError, match="one bound"):
        scenarios.Target("ratio")


def _fake_scenario_runs(measured: dict):
    """A stand-in for run_module: each scenario's injected measurement, None: it failed."""
    def run_module(module, arguments, directory):
        name = arguments[arguments.index("--scenario") + 1]
        if measured[name] is None:
            return runner.FreshRun(None, "RuntimeError: boom", 1.0)
        return runner.FreshRun(measured[name], wall_s=1.0)
    return run_module


def test_a_missed_target_is_printed_and_a_failed_scenario_exits_1(tmp_path, monkeypatch,
                                                                    capsys):
    monkeypatch.setattr(runner, "build_extension", lambda stream: None)
    monkeypatch.setattr(runner, "run_module", _fake_scenario_runs({
        "tiny_chain": {"eager_s": 0.10, "adaptive_s": 0.10, "intercepted": 0},
        "large_chain8": {"eager_s": 0.10, "adaptive_s": 0.05, "fused": "20/20", "per_op": {}},
        "tiny_mlp": None}))
    out = tmp_path / "scenarios.json"
    arguments = ["bench", "--scenarios", "tiny_chain", "large_chain8", "--quick"]
    assert main([*arguments, "--json", str(out)]) == 0             # a miss is no failure
    captured = capsys.readouterr()
    assert "[2/2] large_chain8 … 1.0 s" in captured.err
    header, chain, large = captured.out.splitlines()[1:4]
    assert header.split()[:2] == ["scenario", "eager"]
    assert "ratio ≤ 1.1: 1.00 met" in chain and "ops intercepted while timed: 0" in chain
    assert "speedup ≥ 4: 2.00 MISSED" in large and "fused 20/20" in large
    assert "targets met: 1 of 2" in captured.out
    assert "MISSED: large_chain8: speedup ≥ 4 (measured 2.00)" in captured.out
    payload = json.loads(out.read_text())
    assert payload["command"] == "adaptive-eager bench --scenarios tiny_chain large_chain8 --quick"
    assert [t["met"] for r in payload["results"] for t in r["targets"]] == [True, False]
    assert main(["bench", "--scenarios", "tiny_mlp"]) == 1
    assert "FAILED: tiny_mlp: RuntimeError: boom" in capsys.readouterr().out


def test_paired_blocks_last_long_enough_on_short_steps_and_are_bounded():
    from adaptive_eager.benchmarks.child import (MOST_PAIRED_BLOCK_STEPS, PAIRED_BLOCK_S,
                                                 paired_block_steps)
    assert paired_block_steps(10, 0.5) == 5                       # long steps: N/2
    assert paired_block_steps(10, PAIRED_BLOCK_S / 40) == 40      # short: PAIRED_BLOCK_S worth
    assert paired_block_steps(10, 1e-9) == MOST_PAIRED_BLOCK_STEPS
    assert paired_block_steps(1, 1.0) == 2                        # a block's first step is dropped
