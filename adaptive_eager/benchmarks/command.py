"""``adaptive-eager bench``: validate the arguments, run the plan, show and write the report.

Exit status: 0 when every output matched eager (skipped workloads included), 1 on an output
mismatch or a failed child, 2 on bad arguments or a missing optional dependency. With
--scenarios: 0 when every scenario ran, whether or not it met its targets (a miss is printed:
timings move with the machine's load, as a slow ratio in the workloads' table does not fail
the command either), 1 when a scenario's process failed.
"""
from __future__ import annotations

import argparse
import sys
import warnings

from adaptive_eager.benchmarks import report, results, runner


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The bench subcommand's arguments (no torch import: every CLI command builds them)."""
    parser.add_argument("--workload", nargs="+", metavar="NAME",
                        help="workloads to run (default: chain8 and ln_gelu_residual "
                             "large, train_step and transformer_block medium; --list shows "
                             "all)")
    parser.add_argument("--size", nargs="+", metavar="SIZE",
                        help="tiny, medium and/or large (default: large, or the default's "
                             "sizes)")
    parser.add_argument("--modes", metavar="M,M",
                        help="comma-separated among eager,eager+malloc,adaptive,compile "
                             "(default: all four; eager always runs, it is the reference)")
    parser.add_argument("--iters", type=int, default=runner.DEFAULT_ITERS, metavar="N",
                        help=f"cold steps timed from the start, and steady steps timed after "
                             f"warm-up (default: {runner.DEFAULT_ITERS})")
    parser.add_argument("--all", action="store_true", dest="run_all",
                        help="every workload at every size (unless --workload/--size narrow it)")
    parser.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    parser.add_argument("--json", metavar="OUT", help="write the results as JSON")
    parser.add_argument("--markdown", metavar="OUT", help="write a markdown page (BENCHMARKS.md)")
    parser.add_argument("--plot", metavar="OUT.png", help="bar chart of ratios (needs matplotlib)")
    parser.add_argument("--list", action="store_true",
                        help="list workloads, sizes and scenarios, run nothing")
    parser.add_argument("--scenarios", nargs="*", metavar="NAME",
                        help="the adaptive policy's scenarios instead of the workloads, each "
                             "checked against its targets (default: all of them; --list shows "
                             "them)")
    parser.add_argument("--quick", action="store_true",
                        help="with --scenarios: fewer steps and fresh-process pairs")
    parser.add_argument("--coverage", action="store_true",
                        help="the real-model coverage suite (Hugging Face architectures) "
                             "instead of the workloads; --markdown writes docs/coverage.md")
    parser.add_argument("--arch", nargs="+", metavar="TYPE",
                        help="with --coverage: these architectures (model types; default: all)")
    parser.add_argument("--from-json", nargs="+", metavar="JSON",
                        help="with --coverage: run nothing, show (and --markdown) the results "
                             "that earlier --coverage --json runs, and decode.py, wrote")
    parser.add_argument("--note", metavar="TEXT",
                        help="with --coverage --markdown: a paragraph for the page (e.g. "
                             "which runs and commits its saved results come from)")
    parser.add_argument("--no-timing", action="store_true",
                        help="with --coverage: parity only, no steady timing (and no decode "
                             "benchmark, which runs when every architecture does)")


def _list_workloads() -> int:
    from adaptive_eager.benchmarks import scenarios
    from adaptive_eager.benchmarks.workloads import WORKLOADS
    for workload in WORKLOADS.values():
        needs = f"  [needs {workload.requires}]" if workload.requires else ""
        print(f"{workload.name:<18}{workload.description}{needs}")
        for size, shape in workload.shapes.items():
            print(f"    {size:<8}{shape}")
    print("\n" + "\n".join(scenarios.listing()))
    return 0


def _error(message: str) -> int:
    print(f"adaptive-eager bench: {message}", file=sys.stderr)
    return 2


def run(options: argparse.Namespace) -> int:
    # numpy is no dependency of ours; torch warns when it is missing, among the progress lines.
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    if options.list:
        return _list_workloads()
    if options.scenarios is not None:
        return _run_scenarios(options)
    if options.coverage:
        return _run_coverage(options)
    try:
        plan = runner.make_plan(options.workload, options.size, options.modes, options.iters,
                                options.run_all, options.device)
        if options.plot:
            report.require_matplotlib()        # before minutes of measuring, not after
    except (runner.PlanError, report.PlotUnavailable) as err:
        return _error(str(err))
    rows = runner.run(plan)
    _write_outputs(options, plan, rows)
    return 1 if results.any_failure(rows) else 0


def _run_coverage(options: argparse.Namespace) -> int:
    from adaptive_eager.benchmarks import coverage_table
    try:
        archs = coverage_table.choose(options.arch)
    except runner.PlanError as err:
        return _error(str(err))
    if options.from_json:
        results_, decode = coverage_table.load(options.from_json, archs)
    else:
        results_ = coverage_table.run(archs, timing=not options.no_timing,
                                      json_path=options.json)
        decode = None if options.no_timing or options.arch else coverage_table.run_decode()
    parts = ["adaptive-eager bench --coverage"]
    if options.from_json:
        parts.append(f"--from-json {' '.join(options.from_json)}")
    if options.arch:
        parts.append(f"--arch {' '.join(options.arch)}")
    if options.no_timing:
        parts.append("--no-timing")
    if options.markdown:
        parts.append(f"--markdown {options.markdown}")
    coverage_table.write(results_, " ".join(parts), options.markdown, options.json, decode,
                         options.note)
    return 0 if all(result.passed for result in results_) else 1


def _run_scenarios(options: argparse.Namespace) -> int:
    from adaptive_eager.benchmarks import scenarios
    if options.coverage or options.markdown or options.plot:
        return _error("--scenarios goes without --coverage, --markdown and --plot")
    try:
        names = scenarios.choose(options.scenarios)
    except runner.PlanError as err:
        return _error(str(err))
    outcomes = scenarios.run(names, options.quick)
    info = report.machine()
    print(scenarios.text_table(outcomes, info))
    if options.json:
        command = " ".join(["adaptive-eager bench --scenarios", *options.scenarios]
                           + (["--quick"] if options.quick else []))
        report.write_json(options.json,
                          scenarios.json_payload(outcomes, info, command, options.quick))
    return 1 if scenarios.any_failure(outcomes) else 0


def command_line(options: argparse.Namespace) -> str:
    """The command that reproduces this run (what BENCHMARKS.md says it was generated by)."""
    parts = ["adaptive-eager bench"]
    if options.run_all:
        parts.append("--all")
    for flag, values in (("--workload", options.workload), ("--size", options.size)):
        if values:
            parts.append(f"{flag} {' '.join(values)}")
    if options.modes:
        parts.append(f"--modes {options.modes}")
    if options.iters != runner.DEFAULT_ITERS:
        parts.append(f"--iters {options.iters}")
    if options.device != "cpu":
        parts.append(f"--device {options.device}")
    if options.markdown:
        parts.append(f"--markdown {options.markdown}")
    return " ".join(parts)


def _write_outputs(options: argparse.Namespace, plan: runner.Plan, rows: list) -> None:
    info = report.machine()
    command = command_line(options)
    print(report.text_table(rows, info, plan.iters))
    if options.json:
        report.write_json(options.json,
                          report.json_payload(rows, info, command, plan.iters))
    if options.markdown:
        with open(options.markdown, "w") as file:
            file.write(report.markdown(rows, info, command, plan.iters))
    if options.plot:
        report.plot(rows, info, options.plot)
