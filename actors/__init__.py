"""The data plane: model loading, the fast model runner with per-sequence KV caches,
the drafters, pure sampling/acceptance functions, and the speculative engine.

Everything here runs in-process without Ray (tests, `specd generate --local`);
the cluster's draft and verifier deployments wrap these pieces.

Importing it quiets two libraries in this process: torchao (which transformers' quantizers import)
logs a warning for each CUDA or MX kernel library a CPU build lacks, and registers enums that
torch's pytree warns about; neither concerns a user (errors still show).
"""
import logging as _logging

for _name in ("torchao", "torch.utils._pytree"):
    _logging.getLogger(_name).setLevel(_logging.ERROR)
