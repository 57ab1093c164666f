"""Values that pick behaviour are enums checked once at configuration time: a bad scheme, rule or
backend is refused naming the key, the value and the choices; a good one is a member however the
section was built, still reads as its word in files, and the code compares members."""

from __future__ import annotations

import ast
import dataclasses
import json
import pickle
import typing
from enum import Enum
from pathlib import Path

import pytest

import gyre
from gyre.config import (ConfigError, EngineBackend, GyreConfig, SchedConfig, Scheme, StalenessRule, TrainBackend,
                         TrainConfig, load_config, to_dict)
from gyre.sched import SCHEMES, make_policy
from gyre.traj.record import FINISHED, NOT_FINISHED, STATUSES, ExecutionRecord, Status


@pytest.mark.parametrize("override,needle", [
    ("sched.scheme=B", "sched.scheme: 'B' is not allowed; choose one of E, E-paper, A, C"),
    ("sched.scheme=e", "sched.scheme: 'e' is not allowed; choose one of E, E-paper, A, C"),
    ("sched.staleness_rule=fifo", "sched.staleness_rule: 'fifo' is not allowed; choose one of window, count"),
    ("engine.backend=tgi", "engine.backend: 'tgi' is not allowed; choose one of embedded, sglang, vllm"),
    ("train.backend=deepspeed", "train.backend: 'deepspeed' is not allowed; choose one of embedded, megatron"),
    ("sched.scheme=3", "sched.scheme: '3' is not allowed"),
])
def test_a_bad_choice_is_refused_naming_key_value_and_choices(override, needle):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert needle in str(e.value)


def test_bad_choice_in_a_file_and_in_code(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('[sched]\nstaleness_rule = "sliding"\n')
    with pytest.raises(ConfigError, match="sched.staleness_rule: 'sliding' is not allowed; choose one of window"):
        load_config(f)
    with pytest.raises(ConfigError, match="sched.scheme: 'Z' is not allowed"):
        SchedConfig(scheme="Z")  # a section built in code is checked the same way
    with pytest.raises(ConfigError, match="train.backend: 'x' is not allowed"):
        TrainConfig(backend="x")


def test_good_choices_are_members_that_read_as_their_word():
    cfg = load_config(None, ["sched.scheme=E-paper", "sched.staleness_rule=count", "engine.backend=sglang",
                             "train.backend=megatron"])
    s = cfg.sched
    assert s.scheme is Scheme.E_PAPER and s.staleness_rule is StalenessRule.COUNT
    assert cfg.engine.backend is EngineBackend.SGLANG and cfg.train.backend is TrainBackend.MEGATRON
    assert SchedConfig(scheme="A").scheme is Scheme.A and TrainConfig().backend is TrainBackend.EMBEDDED
    # files, reports and labels hold the same words as before
    d = json.loads(json.dumps(to_dict(cfg)))
    assert d["sched"]["scheme"] == "E-paper" and d["engine"]["backend"] == "sglang"
    assert f"{s.scheme}{s.staleness}" == "E-paper0" and str(s.staleness_rule) == "count"
    assert pickle.loads(pickle.dumps(cfg)).sched.scheme is Scheme.E_PAPER  # over the MPI link
    # the trainer ranks rebuild their TrainConfig from a dict
    assert TrainConfig(**to_dict(GyreConfig())["train"]).backend is TrainBackend.EMBEDDED


def test_one_list_of_schemes_and_each_has_its_policy():
    assert SCHEMES == tuple(m.value for m in Scheme) == ("E", "E-paper", "A", "C")
    for m in Scheme:
        assert make_policy(m).scheme is m and make_policy(m.value).scheme is m
    with pytest.raises(ValueError, match="unknown scheme 'Q'"):
        make_policy("Q")


def test_execution_status_keeps_its_words_on_disk():
    assert STATUSES == ("running", "done", "failed", "crashed", "timeout", "stopped", "lost")
    assert set(FINISHED) | set(NOT_FINISHED) | {Status.RUNNING} == set(Status)
    rec = ExecutionRecord("e", "t", status=Status.TIMEOUT)
    assert json.dumps({"status": rec.status}) == '{"status": "timeout"}'
    assert "timeout" in FINISHED and Status("stopped") in NOT_FINISHED  # a word read back from a shard


def _enum_fields() -> dict[str, set[str]]:
    """Every choice key of the configuration (its field name) and its words."""
    out: dict[str, set[str]] = {}
    for sec in dataclasses.fields(GyreConfig):
        hints = typing.get_type_hints(type(sec.default_factory()))
        for name, kind in hints.items():
            if isinstance(kind, type) and issubclass(kind, Enum):
                out.setdefault(name, set()).update(m.value for m in kind)
    return out


# comparisons that pick behaviour by these words, outside the definitions: every choice key of the
# configuration, the execution status and the staleness rule's other name
_CHOICES = _enum_fields() | {"status": {s.value for s in Status}, "rule": {r.value for r in StalenessRule}}
_WORDS = set().union(*_CHOICES.values())
_FIELDS = set(_CHOICES)


def test_every_choice_key_is_an_enum():
    """A key with a fixed list of words is a StrEnum (checked once), not a str with `choices`."""
    for sec in dataclasses.fields(GyreConfig):
        for f in dataclasses.fields(sec.default_factory()):
            assert not (f.metadata.get("choices") and not isinstance(f.default, Enum)) or f.name == "tiny_family", \
                f"{sec.name}.{f.name}: make it a StrEnum in gyre/config.py"
    assert {"advantage", "layout", "off_policy", "dtype", "chat_template", "history", "tool_parser",
            "reasoning_parser", "sandbox", "runtime", "resume", "executor", "network", "output", "compression",
            "burst_order", "sandbox_network", "wandb_mode"} <= _FIELDS


def test_code_compares_members_not_words():
    bad = []
    for f in sorted(Path(gyre.__file__).parent.rglob("*.py")):
        if "harness/builtin" in f.as_posix():
            continue
        for node in ast.walk(ast.parse(f.read_text())):
            if not isinstance(node, ast.Compare):
                continue
            names = {_name(x) for x in [node.left, *node.comparators]}
            words = {x.value for x in [node.left, *node.comparators] if isinstance(x, ast.Constant)}
            words |= {e.value for x in node.comparators if isinstance(x, (ast.Tuple, ast.List, ast.Set))
                      for e in x.elts if isinstance(e, ast.Constant)}
            if any(words & _CHOICES[n] for n in names & _FIELDS):
                bad.append(f"{f.name}:{node.lineno}")
    assert not bad, f"compare enum members, not strings: {bad}"


def _name(x: ast.AST) -> str | None:
    if isinstance(x, ast.Attribute):
        return x.attr
    if isinstance(x, ast.Name):
        return x.id
    return None
