"""Hostile speculative configs (property-based): every dict either builds a valid SparseverConfig or
is refused with SparseverConfigError naming the field; nothing else escapes (no TypeError,
OverflowError, RecursionError...), and an accepted config has no impossible value."""

import dataclasses
import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_sparsever.config import SECTIONS, SparseverConfig, SparseverConfigError

TOP_FIELDS = [f.name for f in dataclasses.fields(SparseverConfig) if f.name != "passthrough"]
SECTION_FIELDS = {name: [f.name for f in dataclasses.fields(cls)] for name, cls in SECTIONS.items()}

scalars = st.one_of(
    st.none(), st.booleans(),
    st.integers(), st.sampled_from([0, -1, 1, 2, 10**6, 10**18, 2**63, -(2**63)]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12), st.sampled_from(["auto", "draft_model", "ngram", "early_exit", "sparsever", ""]),
)
junk = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                     st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                    max_leaves=12)


@st.composite
def section_dicts(draw, name):
    keys = draw(st.lists(st.one_of(st.sampled_from(SECTION_FIELDS[name]), st.text(max_size=8)), max_size=5))
    return {k: draw(junk) for k in keys}


@st.composite
def configs(draw):
    raw = {}
    for key in draw(st.lists(st.one_of(st.sampled_from(TOP_FIELDS), st.text(max_size=10)), max_size=6)):
        if key in SECTIONS and draw(st.booleans()):
            raw[key] = draw(section_dicts(key))
        else:
            raw[key] = draw(junk)
    if draw(st.booleans()):
        raw["num_speculative_tokens"] = draw(st.one_of(st.integers(min_value=1, max_value=16), junk))
    if draw(st.booleans()):
        raw["method"] = draw(st.sampled_from(["sparsever", "ngram", 3, None]))
    return raw


def _numbers(obj, path=""):
    if dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            yield from _numbers(getattr(obj, f.name), f"{path}{f.name}.")
    elif isinstance(obj, bool):
        return
    elif isinstance(obj, (int, float)):
        yield path.rstrip("."), obj
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _numbers(v, f"{path}{i}.")


# Valid configs a hostile edit starts from (the edit then replaces or adds one field).
TEMPLATES = [
    {"method": "sparsever", "num_speculative_tokens": 3, "model": "/draft"},
    {"method": "sparsever", "num_speculative_tokens": 4, "prompt_lookup_max": 3},
    {"method": "sparsever", "num_speculative_tokens": 8, "model": "/draft",
     "tree": {"enabled": True, "depth": 4}, "adaptive": {"enabled": True}},
    {"method": "sparsever", "num_speculative_tokens": 6, "draft_source": "ngram",
     "attention": {"enabled": True, "top_k_blocks": 4}, "ffn": {"enabled": True, "keep_ratio": 0.5},
     "early_exit": {"enabled": True, "intermediate": "sparse", "round_tokens": 2}},
]
hostile_values = st.one_of(junk, st.sampled_from([10**18, 2**31, 2**40, -5, float("inf"), float("nan"), 1e300,
                                                  "", [], {}, [[[]]], {"enabled": {"x": 1}}]))


@st.composite
def edited_templates(draw):
    raw = {k: (dict(v) if isinstance(v, dict) else v) for k, v in draw(st.sampled_from(TEMPLATES)).items()}
    for _ in range(draw(st.integers(1, 2))):
        key = draw(st.sampled_from(TOP_FIELDS + ["unknown_section", "method"]))
        if key in SECTIONS and draw(st.booleans()):
            section = dict(raw[key]) if isinstance(raw.get(key), dict) else {}
            section[draw(st.sampled_from(SECTION_FIELDS[key] + ["junk"]))] = draw(hostile_values)
            raw[key] = section
        else:
            raw[key] = draw(hostile_values)
    return raw


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(configs(), edited_templates()))
def test_hostile_configs_are_refused_by_name_or_valid(raw):
    try:
        config = SparseverConfig.from_dict(dict(raw))
    except SparseverConfigError as e:
        assert str(e).strip(), raw
        return
    for name, value in _numbers(config):
        assert math.isfinite(value), (name, value, raw)
        assert abs(value) <= 2**31 - 1, (name, value, raw)  # nothing absurd gets through
    assert config.num_speculative_tokens <= 256
