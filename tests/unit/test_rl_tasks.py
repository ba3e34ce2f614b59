"""rl/tasks.py: prompts agreed from (run, round), held-out split, local verifiers (G15, G17)."""

import pytest

from rl.tasks import ArithTask, Prompt, RGymTask, prompt_id, round_seed


def test_same_run_and_round_same_prompts_on_every_peer():
    a, b = ArithTask(), ArithTask()
    p1, p2 = a.prompts("run", 3, 16), b.prompts("run", 3, 16)
    assert [p.text for p in p1] == [p.text for p in p2]
    assert [p.prompt_id for p in p1] == [p.prompt_id for p in p2]
    assert len({p.prompt_id for p in p1}) == 16 and all(len(p.prompt_id) == 32 for p in p1)
    assert [p.text for p in a.prompts("run", 4, 16)] != [p.text for p in p1]
    assert [p.text for p in a.prompts("other", 3, 16)] != [p.text for p in p1]
    assert round_seed("run", 3) != round_seed("run", 4)
    assert prompt_id("s", 1, 2, 3) != prompt_id("s", 1, 2, 4)


def test_heldout_split_is_disjoint_from_training_prompts():
    t = ArithTask()
    held = t.heldout(200)
    assert len(held) == 200 and all(t.is_heldout(p.data["operands"]) for p in held)
    held_texts = {p.text for p in held}
    train = {p.text for r in range(50) for p in t.prompts("run", r, 16)}
    assert not held_texts & train
    assert [p.text for p in t.heldout(20)] == [p.text for p in held[:20]]


def test_operand_ranges():
    t = ArithTask(min_operands=2, max_operands=3, max_operand=9)
    for p in t.prompts("r", 0, 100):
        ops = p.data["operands"]
        assert 2 <= len(ops) <= 3 and all(0 <= x <= 9 for x in ops)
        assert p.text == "+".join(map(str, ops)) + ":" and int(p.answer) == sum(ops)
    big = ArithTask(max_operand=99)
    assert max(max(p.data["operands"]) for p in big.prompts("r", 0, 100)) > 9


def test_reference_solution_and_verifier():
    p = Prompt(b"x" * 32, "3+4+1:", "8", {"operands": (3, 4, 1)})
    assert ArithTask.reference(p) == "3+4=7,7+1=8=>8\n"
    assert ArithTask.reward(p, ArithTask.reference(p)) == 1.0
    assert ArithTask.reward(p, "=>8 and then some") == 1.0          # trailing text ignored
    assert ArithTask.reward(p, "3+4=7=>9=>8") == 0.0                 # first => counts
    assert ArithTask.reward(p, "8") == 0.0                           # no => marker
    assert ArithTask.reward(p, "=>80") == 0.0
    assert ArithTask.reward(p, "\ufffd\x00=>") == 0.0                # garbage never raises
    zero = Prompt(b"z" * 32, "0+0:", "0", {"operands": (0, 0)})
    assert ArithTask.reward(zero, "0+0=0=>0") == 1.0
    for q in ArithTask().prompts("r", 1, 20):                        # reference always right
        assert ArithTask.reward(q, ArithTask.reference(q)) == 1.0


def test_reward_depends_only_on_local_prompt_and_text():
    """G15: the reward is computed from (prompt regenerated locally, completion text) alone."""
    t = ArithTask()
    p = t.prompts("run", 0, 1)[0]
    again = t.prompts("run", 0, 1)[0]
    wrong = str(int(p.answer) + 1)
    assert t.reward(again, f"=>{p.answer}") == 1.0 and t.reward(again, f"=>{wrong}") == 0.0


def test_rgym_adapter():
    pytest.importorskip("reasoning_gym")
    t = RGymTask(names=("basic_arithmetic", "chain_sum"))
    p1, p2 = t.prompts("run", 2, 4), t.prompts("run", 2, 4)
    assert [p.text for p in p1] == [p.text for p in p2]
    assert [p.prompt_id for p in p1] == [p.prompt_id for p in p2]
    assert [p.text for p in t.prompts("run", 3, 4)] != [p.text for p in p1]
    for p in p1:
        assert t.reward(p, t.reference(p)) == 1.0
        assert t.reward(p, p.answer) == 0.0                           # no <answer> span
        assert t.reward(p, "<answer>definitely wrong</answer>") == 0.0


def test_rgym_missing_package_says_what_to_do(monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)          # import now fails
    with pytest.raises(ImportError, match=r"swarmnode\[rgym\]"):
        RGymTask().prompts("run", 0, 1)


def test_make_task_follows_the_grpo_section():
    from rl.grpo_config import GRPOConfig
    from rl.tasks import make_task
    arith = make_task(GRPOConfig(max_operand=5, max_operands=3))
    assert isinstance(arith, ArithTask) and arith.max_operand == 5 and arith.max_operands == 3
    rgym = make_task(GRPOConfig(task="rgym", rgym_datasets=["gcd", "lcm"]))
    assert isinstance(rgym, RGymTask) and rgym.names == ("gcd", "lcm")
