"""Search-space files: the shipped ones load, bad ones report every problem with file and key."""

from __future__ import annotations

import pytest

from autotune.errors import ConfigError
from autotune.sweep.space.search_space import SPACES_DIR, check_search_space, load_search_space


@pytest.mark.parametrize("path", sorted(SPACES_DIR.glob("*.yaml")), ids=lambda p: p.stem)
def test_shipped_spaces_load_and_have_a_valid_safe_config(path):
    space = load_search_space(path.stem)
    assert space.source == f"autotune/search_spaces/{path.name}"
    grid = space.valid_grid()
    # shipped choices never break a rule on one GPU, but a rollout engine or a sequence split
    # spanning 2 or 4 GPUs, which needs a run of that many (the trainers' spaces search them)
    one_gpu = [p for p in space.grid() if p.get("rollout_tensor_parallel", 1) == 1
               and p.get("ulysses_sequence_parallel_size", 1) == 1]
    assert grid and len(grid) == len(one_gpu)
    safe = space.safe_params()
    assert not space.problems_for(safe)
    for name in ("gradient_checkpointing", "offload_params", "offload_optimizer"):
        if name in space.params:
            assert safe[name] is True
    for name in ("micro_batch_size_update", "micro_batch_size_experience"):
        if name in space.params:  # TRL has no log-prob micro-batch
            assert safe[name] == min(space.params[name].values())
    for name in space.trainer_keys:  # the lightest value of a trainer's own key
        spec = space.params[name]
        assert safe[name] == (min if spec.memory_direction > 0 else max)(spec.values())


def test_default_grpo_space_keeps_the_algorithm_fixed():
    space = load_search_space("grpo")
    assert "rollout_n" in space.fixed and "global_batch_size" in space.fixed
    assert "rollout_n" in load_search_space("grpo-search-n").params


def test_every_problem_is_reported_with_file_and_key(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(
        "params:\n"
        "  micro_batch_size_updat: {type: categorical, choices: [1, 2]}\n"
        "  micro_batch_size_experience: {type: int, low: 8, high: 2}\n"
        "  gradient_checkpointing: {type: float}\n"
        "  rollout_n: {type: int, low: 2, high: 16, step: 2, log: true}\n"
        "  offload_params: {type: categorical, choices: [maybe]}\n"
        "fixed:\n"
        "  max_response_length: -5\n"
        "extra: 1\n")
    space, problems = check_search_space(str(path))
    assert space is None
    text = "\n".join(problems)
    for expected in ["bad.yaml: unknown section 'extra'",
                     "bad.yaml: params.micro_batch_size_updat: unknown knob",
                     "did you mean micro_batch_size_update",
                     "params.micro_batch_size_experience: low=8 is above high=2",
                     "params.gradient_checkpointing.type: 'float' is not one of",
                     "params.rollout_n: log=true needs step=1",
                     "params.offload_params.choices[0]: offload_params='maybe'",
                     "fixed.max_response_length: max_response_length=-5: must be at least 1"]:
        assert expected in text, expected
    assert all(p.startswith(str(path)) for p in problems)


def test_yaml_syntax_error_names_the_line(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("params:\n  a: [1, 2\n")
    with pytest.raises(ConfigError, match=r"broken.yaml:\d+: not valid YAML"):
        load_search_space(str(path))


def test_a_space_with_no_valid_combination_is_refused(tmp_path):
    path = tmp_path / "none.yaml"
    path.write_text("params:\n  micro_batch_size_update: {type: categorical, choices: [3, 5]}\n"
                    "fixed: {rollout_batch_size: 4, rollout_n: 2, global_batch_size: 2}\n")
    with pytest.raises(ConfigError, match="no combination of params and fixed passes"):
        load_search_space(str(path))


def test_hash_follows_content_not_spelling(tmp_path):
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text("params:\n  gradient_checkpointing: {type: bool}\n"
                 "  micro_batch_size_update: {type: categorical, choices: [1, 2]}\n"
                 "fixed: {max_response_length: 64}\n")
    b.write_text("# same space, other order\nfixed:\n  max_response_length: '64'\nparams:\n"
                 "  micro_batch_size_update: {type: categorical, choices: [1, 2]}\n"
                 "  gradient_checkpointing: {type: bool}\n")
    space_a, space_b = load_search_space(str(a)), load_search_space(str(b))
    assert space_a.space_hash == space_b.space_hash
    assert space_a.with_fixed({"max_response_length": 32}).space_hash != space_a.space_hash


def test_int_params_enumerate_with_step_and_log(tmp_path):
    path = tmp_path / "ints.yaml"
    path.write_text("params:\n  micro_batch_size_update: {type: int, low: 1, high: 4}\n"
                    "  micro_batch_size_experience: {type: int, low: 2, high: 8, step: 2}\n"
                    "fixed: {rollout_batch_size: 8, rollout_n: 4, global_batch_size: 8}\n")
    space = load_search_space(str(path))
    assert space.params["micro_batch_size_experience"].values() == (2, 4, 6, 8)
    assert space.grid_size == 16
    valid = space.valid_grid()  # 32 responses: 3 and 6 do not divide
    assert len(valid) == 9 and {"micro_batch_size_update": 3} not in valid
    dists = space.distributions()
    assert dists["micro_batch_size_experience"].step == 2


def test_unknown_space_name_suggests_shipped_ones():
    with pytest.raises(ConfigError, match="did you mean grpo"):
        load_search_space("grp")


def test_user_values_fix_knobs_and_queue_the_base_config():
    space = load_search_space("cpu-demo")
    base = {"micro_batch_size_update": 4, "max_response_length": 32, "rollout_n": 2}
    tuned, base_params = space.with_user_values({"max_prompt_length": 16}, base, "mine.yaml")
    assert tuned.fixed["max_response_length"] == 32 and tuned.fixed["rollout_n"] == 2
    assert tuned.fixed["max_prompt_length"] == 16
    assert base_params == {**tuned.safe_params(), "micro_batch_size_update": 4}
    assert tuned.space_hash != space.space_hash
    with pytest.raises(ConfigError, match="--set micro_batch_size_update: searched by"):
        space.with_user_values({"micro_batch_size_update": 2}, {})
    with pytest.raises(ConfigError, match=r"mine.yaml: micro_batch_size_update=3 is not among"):
        space.with_user_values({}, {"micro_batch_size_update": 3}, "mine.yaml")


def test_headroom_parsing():
    from autotune.config import parse_headroom

    assert parse_headroom("10%") == pytest.approx(0.10) and parse_headroom("0.25") == 0.25
    for bad in ("100%", "-1", "lots"):
        with pytest.raises(ConfigError, match="--headroom"):
            parse_headroom(bad)


TRAINER_SPACE = """\
params:
  micro_batch_size_update: {type: categorical, choices: [1, 2, 4]}
  worker.rollout.gpu_memory_utilization:
    {type: categorical, choices: [0.4, 0.6, 0.8], memory_direction: 1}
  worker.rollout.enforce_eager: {type: bool, memory_direction: 0}
fixed:
  worker.rollout.max_num_batched_tokens: 8192
"""


def test_a_trainers_own_keys_are_searched_with_their_declared_direction(tmp_path):
    from autotune.hardware import Device
    from autotune.sweep.feasibility.dominance import Dominance
    from autotune.sweep.feasibility.screen import Feasibility

    path = tmp_path / "easyr1.yaml"
    path.write_text(TRAINER_SPACE)
    space = load_search_space(str(path))
    assert space.trainer_keys == ("worker.rollout.gpu_memory_utilization",
                                  "worker.rollout.enforce_eager",
                                  "worker.rollout.max_num_batched_tokens")
    safe = space.safe_params()
    assert safe["worker.rollout.gpu_memory_utilization"] == 0.4  # the lightest
    params = {**safe, "micro_batch_size_update": 2}
    assert space.config_for(params).micro_batch_size_update == 2  # knobs only
    assert space.trainer_values(params) == {
        "worker.rollout.max_num_batched_tokens": 8192,
        "worker.rollout.gpu_memory_utilization": 0.4,
        "worker.rollout.enforce_eager": safe["worker.rollout.enforce_eager"]}
    # a measured OOM at 0.6 proves 0.8 must OOM too, and says nothing about 0.4
    feasibility = Feasibility(Device("cpu"), Dominance(space.directions))
    oom = {**params, "worker.rollout.gpu_memory_utilization": 0.6}
    feasibility.record(3, space.candidate(oom), "gpu_oom")
    assert feasibility.predict(space.candidate(
        {**oom, "worker.rollout.gpu_memory_utilization": 0.8}))
    assert feasibility.predict(space.candidate(
        {**oom, "worker.rollout.gpu_memory_utilization": 0.4})) is None
    flipped = not oom["worker.rollout.enforce_eager"]  # no direction: only equal values count
    assert feasibility.predict(space.candidate(
        {**oom, "worker.rollout.enforce_eager": flipped})) is None


@pytest.mark.parametrize("entry, problem", [
    ("worker.rollout.gpu_memory_utilizaton: {type: categorical, choices: [0.4]}",
     "also needs memory_direction"),
    ("micro_batch_size_update: {type: categorical, choices: [1], memory_direction: 1}",
     "is a knob; its direction is known"),
    ("a.b: {type: categorical, choices: [0.4], memory_direction: 2}", "expected 1"),
    ("a.b: {type: categorical, choices: [x, y], memory_direction: 1}", "numeric choices"),
    ("a.b: {type: categorical, choices: [1, 1], memory_direction: 1}", "listed twice"),
    ("a.b: {type: float, low: 0.1, memory_direction: 1}", "is not one of"),
])
def test_a_bad_trainer_key_is_one_line_with_file_and_key(tmp_path, entry, problem):
    path = tmp_path / "bad.yaml"
    path.write_text(f"params:\n  {entry}\n")
    space, problems = check_search_space(str(path))
    assert space is None and len(problems) == 1
    assert problems[0].startswith(f"{path}: params.") and problem in problems[0]
