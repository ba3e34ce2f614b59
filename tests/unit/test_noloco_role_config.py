"""The noloco role validates its config sections before touching keys, sockets or processes."""

import pytest

from node.config import ConfigError, load_config
from optimizers.noloco_role import NoLoCoRole
from optimizers.noloco_settings import NoLoCoCard
from optimizers.waiting import FINISHING, NEXT_EXCHANGE_AT


def _cfg(**sections):
    return load_config(None, {"role": "noloco", **sections}, environ={})


def test_defaults_and_overrides_validate():
    s = NoLoCoRole.validate_config(_cfg(noloco={"inner_steps": 5, "exit_after_steps": 30}, data={"seq_len": 64}))
    assert s.noloco.inner_steps == 5 and s.noloco.exit_after == 30 and s.data.seq_len == 64
    assert s.model.vocab_size == 256
    assert NoLoCoRole.validate_config(_cfg(noloco={"exit_after": 40})).noloco.exit_after == 40


def test_run_knobs_keep_their_noloco_defaults_and_old_name():
    cfg = NoLoCoRole.validate_config(_cfg()).noloco
    assert (cfg.exit_after, cfg.eval_every, cfg.checkpoint_every, cfg.torch_threads) == (0, 5, 10, 0)
    with pytest.raises(ConfigError, match="keep only exit_after"):
        NoLoCoRole.validate_config(_cfg(noloco={"exit_after_steps": 30, "exit_after": 30}))


def test_card_details_are_the_ones_the_waiting_rules_read():
    assert {FINISHING, NEXT_EXCHANGE_AT, "round"} <= set(NoLoCoCard.model_fields)
    assert NoLoCoCard(round=3, finishing=False).details() == {"round": 3, "finishing": False}
    with pytest.raises(ValueError):
        NoLoCoCard(rounds=3)


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
