"""The noloco role validates its config sections before touching keys, sockets or processes."""

import pytest

from node.config import ConfigError, load_config
from optimizers.noloco_role import NoLoCoRole


def _cfg(**sections):
    return load_config(None, {"role": "noloco", **sections}, environ={})


def test_defaults_and_overrides_validate():
    s = NoLoCoRole.validate_config(_cfg(noloco={"inner_steps": 5, "exit_after_steps": 30}, data={"seq_len": 64}))
    assert s.noloco.inner_steps == 5 and s.noloco.exit_after_steps == 30 and s.data.seq_len == 64
    assert s.model.vocab_size == 256


@pytest.mark.parametrize("sections, field", [
    ({"noloco": {"inner_stepz": 5}}, "noloco.inner_stepz"),
    ({"model": {"d_model": 30, "n_heads": 4}}, "model"),
    ({"data": {"batch_size": 0}}, "data.batch_size"),
    ({"noloco": {"outer": "noloco", "group_size": 1}}, "noloco"),
    ({"noloco": {"pairing": "matchmaking", "round_timeout": 30}}, "noloco"),
    ({"noloco": {"group_size": 4}}, "pairs only"),  # the role would silently pair anyway
])
def test_bad_sections_name_the_field(sections, field):
    with pytest.raises(ConfigError) as exc:
        NoLoCoRole.validate_config(_cfg(**sections))
    assert field in str(exc.value)


def test_diloco_runs_with_its_implicit_global_group():
    assert NoLoCoRole.validate_config(_cfg(noloco={"outer": "diloco"})).noloco.outer == "diloco"


def test_namespaces_register_the_roster():
    assert [ns.name for ns in NoLoCoRole.namespaces(_cfg())] == ["noloco/roster/"]
