"""Offline tooling: calibration (`vllm-sparsever calibrate`, calibration/), early-exit head training
(`train-exits`, train_exits.py), EAGLE-3 head training (`train-eagle`, train_eagle.py and eagle3/;
both on common.py, training.py, training_text.py and training_cli.py) and verify-cost measurement
(`profile-verify`). Serving code never imports this package, nor models/, data/ or store/
(tests/test_import_contracts.py); the CLI joins them."""
