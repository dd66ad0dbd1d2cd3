"""EVICT's MoE cost: the expert-union model (adaptive/experts.py) and the profile's experts term."""

import json
import math

import pytest

from vllm_sparsever.adaptive.cost import Measurement, VerifyCostProfile
from vllm_sparsever.adaptive.evict import Evict
from vllm_sparsever.adaptive.experts import ExpertUnionModel
from vllm_sparsever.trees import DraftTree

E, K = 32, 8


def _independent(n: int) -> float:
    return E * (1 - (1 - K / E) ** n)


def test_union_model_starts_independent_and_learns_sharing():
    model = ExpertUnionModel(E, K)
    assert model.distinct(1) == pytest.approx(K)
    assert model.distinct(0) == 0
    for n in (2, 4, 16):
        assert model.distinct(n) == pytest.approx(_independent(n))
    # Every request's tokens route like 1 + 0.5 (N - 1) independent ones.
    for _ in range(50):
        for n in (4, 8, 12):
            model.observe(n, round(E * -math.expm1((1 + 0.5 * (n - 1)) * math.log1p(-K / E))))
    assert model.sharing == pytest.approx(0.5, abs=0.05)
    assert K < model.distinct(8) < _independent(8)
    # Tokens that all pick the same experts: no extra expert per token.
    shared = ExpertUnionModel(E, K)
    for _ in range(20):
        shared.observe(8, K)
    assert shared.sharing == pytest.approx(0.0, abs=1e-9)
    assert shared.fraction(16) == pytest.approx(K / E)


def test_union_model_rejects_impossible_routing():
    with pytest.raises(ValueError, match="top_k"):
        ExpertUnionModel(8, 9)
    dense_routing = ExpertUnionModel(4, 4)  # every token reads every expert
    dense_routing.observe(5, 4)
    assert dense_routing.fraction(3) == 1.0


def _moe_profile(base=0.01, per_token=0.001, experts_s=0.02) -> VerifyCostProfile:
    """Step time = base + per_token * T + experts_s * X, measured with random and repeated tokens."""
    ms = []
    for mask in ("tree", "chain"):
        for r in (1, 4, 8):
            for q in (1, 2, 4, 8, 16):
                for kind in ("random", "repeated"):
                    if kind == "repeated" and r * q == 1:
                        continue
                    x = 1 - (1 - K / E) ** (r * q) if kind == "random" else K / E
                    ms.append(Measurement(mask, r, q, 256, base + per_token * r * q + experts_s * x, x, kind))
    return VerifyCostProfile(model="m", hardware="h", dtype="float32", measurements=ms, moe=[E, K]).fit()


def test_profile_fit_separates_the_experts_cost():
    profile = _moe_profile()
    assert profile.fit_error["tree"] < 0.02
    coef = profile.coef["tree"]
    assert coef[-1] == pytest.approx(0.02, rel=0.1)  # the experts term
    # Unspecified experts: as spread as independent routing (what random tokens measured).
    independent = profile.predict([8], [256])
    assert independent == pytest.approx(0.01 + 0.008 + 0.02 * (1 - (1 - K / E) ** 8), rel=0.05)
    assert profile.predict([8], [256], experts=K / E) < independent


def test_evict_on_an_moe_target_prices_shared_experts_lower():
    profile = _moe_profile(per_token=0.0002, experts_s=0.05)
    spread, shared = Evict(profile, guard=False), Evict(profile, guard=False)
    assert spread.experts is not None
    for _ in range(30):
        shared.experts.observe(8, K)  # this target's tree nodes all route alike
    assert shared.cost([8], [256]) < spread.cost([8], [256])
    # Rows route independently of each other: two rows read more experts than one.
    assert shared.cost([8, 8], [256, 256]) > shared.cost([8], [256])
    tree = DraftTree(list(range(10, 18)), list(range(-1, 7)), [0.6 ** (i + 1) for i in range(8)])
    kept_spread = len(spread.truncate([tree], [256])[0])
    kept_shared = len(shared.truncate([tree], [256])[0])
    assert kept_shared > kept_spread


def test_profiles_saved_before_the_experts_term_refit_on_load(tmp_path):
    dense = VerifyCostProfile(model="m", hardware="h", dtype="float32", measurements=[
        Measurement(mask, 1, q, 256, 0.01 + 0.001 * q) for mask in ("tree", "chain") for q in (1, 2, 4, 8)]).fit()
    data = json.loads(json.dumps(dense.__dict__, default=lambda o: o.__dict__))
    for m in data["measurements"]:
        del m["experts"], m["tokens"]
    data["coef"] = {mask: c[:-1] for mask, c in data["coef"].items()}  # the old 7 features
    del data["moe"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    loaded = VerifyCostProfile.load(path)
    assert loaded.moe is None and len(loaded.coef["tree"]) == len(dense.coef["tree"])
    assert loaded.predict([4], [256]) == pytest.approx(0.014, rel=0.05)
