"""Offline tooling: calibration (`vllm-sparsever calibrate`), early-exit head training
(`train-exits`) and verify-cost measurement (`profile-verify`). Serving code never imports this
package, nor models/, data/ or store/ (tests/test_import_contracts.py); the CLI joins them."""
