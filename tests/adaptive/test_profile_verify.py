"""`vllm-sparsever profile-verify` on the tiny target: one engine, a small grid, the fitted model."""

import json

import pytest


@pytest.mark.parametrize("config, dtype", [
    ({"dtype": "bfloat16"}, "bfloat16"),             # transformers >= 4.56 writes "dtype"
    ({"torch_dtype": "float16"}, "float16"),
    ({"torch_dtype": "float32"}, "float32"),
    ({}, "float32"),
])
def test_profile_dtype_auto_is_the_models_own(tmp_path, config, dtype):
    # A profile measured in fp32 for a bf16 engine has the wrong shape; "auto" follows the model.
    from vllm_sparsever.offline.profile_verify_cli import model_dtype

    (tmp_path / "config.json").write_text(json.dumps(config))
    assert model_dtype(tmp_path) == dtype


@pytest.mark.slow
@pytest.mark.e2e
def test_profile_verify_writes_a_fitted_profile(tiny_dir, tmp_path, capfd):
    import shutil

    from tiny_models import make_tiny_llama
    from vllm_sparsever.adaptive.cost import VerifyCostProfile, default_cost_profile_path
    from vllm_sparsever.cli import main

    model = make_tiny_llama(tiny_dir / "profiled", seed=0)
    default_cost_profile_path(model).unlink(missing_ok=True)
    out = tmp_path / "cost.json"
    assert main(["profile-verify", str(model), "--rows", "1,2", "--tokens", "1,4,16", "--contexts", "64,256",
                 "--max-context", "256", "--repeats", "2", "--out", str(out)]) == 0
    profile = VerifyCostProfile.load(default_cost_profile_path(model))
    # Progress (tqdm from the worker: points done of the grid, time left).
    err = capfd.readouterr().err
    assert "profile-verify: 100%" in err and "12/12" in err, err[-2000:]
    assert json.loads(out.read_text())["coef"] == profile.coef
    assert profile.dtype == "float32"  # --dtype auto: the tiny model's config
    masks = {m.mask for m in profile.measurements}
    assert masks == {"tree", "chain"}
    # rows 1: q in 1,4,16 x ctx 64,256; rows 2: the same -> 12 points per mask.
    assert len(profile.measurements) == 24 and all(m.seconds > 0 for m in profile.measurements)
    assert set(profile.coef) == {"tree", "chain"}
    # Non-negative coefficients: more tokens or more context never predict a cheaper step.
    for mask in ("tree", "chain"):
        assert all(c >= 0 for c in profile.coef[mask])
        assert profile.predict([16], [256], mask) >= profile.predict([1], [256], mask) > 0
        assert profile.predict([4, 4], [256, 256], mask) >= profile.predict([4], [256], mask)
    shutil.rmtree(model, ignore_errors=True)
