import os
import subprocess
import sys
import textwrap

import pytest
import torch

import adaptive_eager as ae
from adaptive_eager.cli import main
from helpers import MECHANICS_ENV, assert_equal

SCRIPT = textwrap.dedent("""
    import sys
    import torch
    import adaptive_eager as ae
    x = torch.full((8,), float(sys.argv[1]))
    for _ in range(5):
        y = ((x * 2 + 1).sin() * 3).cos()
    torch.save(y, sys.argv[2])
    print("enabled", ae.is_enabled(), "argv", sys.argv[1:])
""")


def test_run_executes_the_script_under_the_runtime(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out_file = tmp_path / "y.pt"
    assert main(["run", str(script), "0.5", str(out_file)]) == 0
    assert "enabled True argv ['0.5'" in capsys.readouterr().out
    assert not ae.is_enabled()                           # disabled again afterwards
    assert ae.stats().fused_executions >= 1
    x = torch.full((8,), 0.5)
    assert_equal(torch.load(out_file), ((x * 2 + 1).sin() * 3).cos())


def test_run_no_compile_in_a_subprocess(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT + "print('compiles', ae.stats().compiles)\n")
    result = subprocess.run(
        [sys.executable, "-m", "adaptive_eager", "run", "--no-compile", str(script), "1.0",
         str(tmp_path / "y.pt")], capture_output=True, text=True, timeout=300,
        env={**os.environ, **MECHANICS_ENV, "NEURON_ADAPTIVE_EAGER_HOT_THRESHOLD": "1"})
    assert result.returncode == 0, result.stderr
    assert "enabled True" in result.stdout and "compiles 0" in result.stdout


def test_missing_script_is_a_clear_error(tmp_path, capsys):
    assert main(["run", str(tmp_path / "nope.py")]) == 2
    assert "no such script" in capsys.readouterr().err


def test_bad_arguments_exit_non_zero():
    with pytest.raises(SystemExit) as info:
        main(["frobnicate"])
    assert info.value.code == 2


def test_config_lists_every_setting(capsys):
    assert main(["config"]) == 0
    out = capsys.readouterr().out
    assert "NEURON_ADAPTIVE_EAGER_HOT_THRESHOLD" in out and "NEURON_ADAPTIVE_EAGER_COMPILE" in out
