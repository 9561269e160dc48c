import pytest

from adaptive_eager.config import SETTINGS, ConfigError, config


@pytest.mark.parametrize("variable, value, accepts", [
    ("NEURON_ADAPTIVE_EAGER_HOT_THRESHOLD", "zero", "integer >= 1"),
    ("NEURON_ADAPTIVE_EAGER_HOT_THRESHOLD", "0", "integer >= 1"),
    ("NEURON_ADAPTIVE_EAGER_MAX_SEGMENT_OPS", "-3", "integer >= 1"),
    ("NEURON_ADAPTIVE_EAGER_COMPILE", "maybe", "1/0"),
    ("NEURON_ADAPTIVE_EAGER_LOG", "loud", "off, warning, info, debug"),
    ("NEURON_ADAPTIVE_EAGER_BUFFER_POOL_MB", "-1", "integer >= 0"),
])
def test_bad_value_names_the_variable_and_what_it_accepts(monkeypatch, variable, value, accepts):
    monkeypatch.setenv(variable, value)
    config.reload()
    with pytest.raises(ConfigError) as info:
        config.validate_all()
    assert variable in str(info.value) and accepts in str(info.value)
    monkeypatch.delenv(variable)
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
