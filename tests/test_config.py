import os
import subprocess
import sys

import pytest

import adaptive_eager as ae

from adaptive_eager.config import SETTINGS, ConfigError, config


# A wrong value for every setting, and what its error must say is accepted.
BAD_VALUES = {
    "ENABLE": ("maybe", "1/0"),
    "COMPILE": ("maybe", "1/0"),
    "BACKEND": ("rust", "auto, cpp, python"),
    "HOT_THRESHOLD": ("zero", "integer >= 1"),
    "MAX_SEGMENT_OPS": ("-3", "integer >= 1"),
    "ASYNC": ("2", "1/0"),
    "COMPILE_TIMEOUT_S": ("0", "integer >= 1"),
    "COMPILE_COST_MS": ("2s", "integer >= 0"),
    "PAUSE": ("sometimes", "1/0"),
    "PAUSE_WINDOW": ("1.5", "integer >= 1"),
    "MIN_SEGMENT_US": ("-1", "integer >= 0"),
    "MIN_US_PER_OP": ("20us", "integer >= 0"),
    "MAX_EXTERN_PERCENT": ("101", "from 0 to 100"),
    "KEEP_UNPROFITABLE": ("keep", "1/0"),
    "MAX_SHAPE_VARIANTS": ("0", "integer >= 1"),
    "BUFFER_POOL_MB": ("-1", "integer >= 0"),
    "MALLOC_TUNING": ("glibc", "1/0"),
    "CACHE_DIR": ("  ", "a directory path"),
    "EXT_DIR": ("  ", "a directory path"),
    "CACHE_SHARED": ("team", "1/0"),
    "CACHE_SIZE": ("many", "integer >= 1"),
    "MAX_KEYS": ("0", "integer >= 1"),
    "CACHE_MAX_ENTRIES": ("", "integer >= 1"),
    "LOG": ("loud", "off, warning, info, debug"),
    "VERIFY": ("paranoid", "strict"),
    "REPORT": ("report.txt", "ending in .json"),
    "DISABLE_KEYS": ("xyz", "hexadecimal digest prefixes"),
}


def test_every_setting_has_a_bad_value_case():
    assert set(BAD_VALUES) == {setting.name for setting in SETTINGS}


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda setting: setting.name)
def test_bad_value_names_the_variable_and_what_it_accepts(monkeypatch, setting):
    value, accepts = BAD_VALUES[setting.name]
    monkeypatch.setenv(setting.env_var, value)
    config.reload()
    with pytest.raises(ConfigError) as info:
        config.validate_all()
    assert setting.env_var in str(info.value) and accepts in str(info.value)
    assert str(info.value).count("\n") == 0                  # one line
    monkeypatch.delenv(setting.env_var)
    config.reload()


def test_enable_refuses_a_bad_setting_and_stays_off(monkeypatch):
    monkeypatch.setenv("NEURON_ADAPTIVE_EAGER_HOT_THRESHOLD", "often")
    config.reload()
    with pytest.raises(ConfigError, match="NEURON_ADAPTIVE_EAGER_HOT_THRESHOLD"):
        ae.enable()
    assert not ae.is_enabled()
    monkeypatch.delenv("NEURON_ADAPTIVE_EAGER_HOT_THRESHOLD")
    config.reload()


def test_a_cache_dir_that_is_a_file_is_refused(monkeypatch, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("NEURON_ADAPTIVE_EAGER_CACHE_DIR", str(blocker))
    config.reload()
    with pytest.raises(ConfigError, match="is not a directory"):
        config.validate_all()
    monkeypatch.delenv("NEURON_ADAPTIVE_EAGER_CACHE_DIR")
    config.reload()


def test_values_are_typed_and_read_once(monkeypatch):
    monkeypatch.setenv("NEURON_ADAPTIVE_EAGER_HOT_THRESHOLD", "7")
    monkeypatch.setenv("NEURON_ADAPTIVE_EAGER_COMPILE", "off")
    config.reload()
    assert config.HOT_THRESHOLD == 7 and config.COMPILE is False
    monkeypatch.setenv("NEURON_ADAPTIVE_EAGER_HOT_THRESHOLD", "9")
    assert config.HOT_THRESHOLD == 7          # read once, not on every access
    config.reload()
    assert config.HOT_THRESHOLD == 9


def test_patch_restores_previous_values():
    before = config.MAX_SEGMENT_OPS
    with config.patch(MAX_SEGMENT_OPS=5):
        assert config.MAX_SEGMENT_OPS == 5
    assert config.MAX_SEGMENT_OPS == before
    with pytest.raises(AttributeError):
        with config.patch(NOT_A_SETTING=1):
            pass


def test_every_setting_has_help_and_a_documented_variable():
    names = {setting.env_var for setting in SETTINGS}
    assert {"NEURON_ADAPTIVE_EAGER", "NEURON_ADAPTIVE_EAGER_COMPILE",
            "NEURON_ADAPTIVE_EAGER_HOT_THRESHOLD", "NEURON_ADAPTIVE_EAGER_MAX_SEGMENT_OPS",
            "NEURON_ADAPTIVE_EAGER_CACHE_DIR", "NEURON_ADAPTIVE_EAGER_LOG"} <= names
    assert all(setting.help for setting in SETTINGS)


@pytest.mark.parametrize("first_import", [
    "from adaptive_eager import config",
    "import adaptive_eager as ae; config = ae.config",
    "import adaptive_eager.config; import adaptive_eager as ae; config = ae.config",
])
def test_the_package_config_reads_settings_however_it_was_first_imported(first_import):
    # A fresh interpreter: which import comes first decides what the package attribute is.
    program = (f"{first_import}\n"
               "with config.patch(HOT_THRESHOLD=7):\n"
               "    print(config.HOT_THRESHOLD, config.ConfigError.__name__)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEURON_ADAPTIVE_EAGER")}
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                            env=env, timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["7", "ConfigError"]
