"""The data plane: model loading, the fast model runner with per-sequence KV caches,
the drafters, pure sampling/acceptance functions, and the speculative engine.

Everything here runs in-process without Ray (tests, `specd generate --local`);
the cluster's draft and verifier deployments wrap these pieces.
"""
