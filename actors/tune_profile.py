"""Tune profiles: what `specd tune` measured offline, and finding the one that fits an engine.

A profile holds, for one target × draft × dtype × quantization mode on one machine:
  - the target's pass cost t(B, T) over a grid of B rows × T tokens per row (`calibrate.PassCost`);
  - the draft's acceptance per position, conditional: accept[j] = P(draft j+1 accepted | the
    first j were), the quantity the speculation policy estimates live (`policy.DrafterEstimate`);
  - the draft's cost per drafted position and step, by batch size;
  - for drafters that draft token trees, the mean accepted path length per node budget.
It is keyed by `hardware.hardware()` (CPU model, flags and threads, or GPU name: the same
fingerprint as the load-time calibration) plus model, draft spec, dtype and quant mode, and a
profile is only used where its key matches exactly: a profile from another machine, thread
count or dtype says nothing about this one.

Where profiles are found: a path named in the config (a profile file, or a directory of them,
e.g. `specd tune --out`), and the store under the cache directory where `specd tune` files each
profile by its key. The newest matching profile wins.

Does not know: how the numbers were measured (specd/tune.py), or what the policy does with them.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from .calibrate import PassCost
from .policy import DraftPrior

KIND = "specd-tune-profile"
QUANT_NONE = "none"  # the only quantization mode so far


def profile_key(hardware: dict, model: str, draft: str, dtype: str, quant: str = QUANT_NONE) -> dict:
    """What a profile is valid for. dtype as the engine reports it ("fp32", "bf16")."""
    return {"hardware": hardware, "model": model, "draft": draft, "dtype": dtype, "quant": quant}


@dataclass
class TuneProfile:
    key: dict  # profile_key(...)
    pass_cost: PassCost
    accept: list[float]  # per draft position: P(accepted | every earlier draft accepted)
    step_s: dict[int, float]  # batch size -> seconds per drafted position per step
    tree: dict[int, float] = field(default_factory=dict)  # tree budget -> mean accepted path length
    tree_row_s: dict[int, float] = field(default_factory=dict)  # tree budget -> seconds drafting one row's tree
    created_at: float = 0.0
    report: dict = field(default_factory=dict)  # predictions, the sweep, settings (for people, not the policy)
    path: str = ""  # where it was read from

    def draft_step_s(self, rows: int) -> float:
        """Seconds per drafted position at `rows` rows: the nearest measured batch at or below."""
        below = [b for b in self.step_s if b <= rows] or [min(self.step_s)]
        return self.step_s[max(below)]

    def prior(self) -> DraftPrior:
        """What the speculation policy starts this drafter from (draft costs: at batch 1; the
        policy's live measurements replace them within a few steps)."""
        return DraftPrior(list(self.accept), self.draft_step_s(1), dict(self.tree), tree_row_s=dict(self.tree_row_s))

    def to_json(self) -> dict:
        return {"kind": KIND, "key": self.key, "created_at": self.created_at, "pass_cost": self.pass_cost.to_json(),
                "accept": self.accept, "step_s": {str(b): s for b, s in sorted(self.step_s.items())},
                "tree": {str(b): n for b, n in sorted(self.tree.items())},
                "tree_row_s": {str(b): s for b, s in sorted(self.tree_row_s.items())}, "report": self.report}

    @classmethod
    def from_json(cls, d: dict, path: str = "") -> "TuneProfile":
        if d.get("kind") != KIND:
            raise ValueError(f"{path or 'profile'}: not a specd tune profile")
        return cls(d["key"], PassCost.from_json(d["pass_cost"]), [float(a) for a in d["accept"]],
                   {int(b): float(s) for b, s in d["step_s"].items()},
                   {int(b): float(n) for b, n in d.get("tree", {}).items()},
                   {int(b): float(s) for b, s in d.get("tree_row_s", {}).items()}, d.get("created_at", 0.0),
                   d.get("report", {}), path)


def store_path(key: dict) -> Path:
    """Where `specd tune` files the profile with this key (under the cache directory)."""
    from .models import cache_dir

    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / "tune" / f"{digest}.json"


def save(profile: TuneProfile, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(profile.to_json(), indent=1))
    os.replace(tmp, path)
    return path


def load_all(where: str | Path | None = None) -> list[TuneProfile]:
    """Every profile in `where` (a file or a directory of *.json) and in the store; files that
    are not profiles are skipped. A named path that does not exist is an error."""
    files: list[Path] = []
    if where is not None:
        where = Path(where)
        if not where.exists():
            raise FileNotFoundError(f"tune profile {str(where)!r} does not exist")
        files += sorted(where.glob("*.json")) if where.is_dir() else [where]
    store = store_path({}).parent
    if store.is_dir():
        files += sorted(store.glob("*.json"))
    out = []
    for f in files:
        try:
            out.append(TuneProfile.from_json(json.loads(f.read_text()), str(f)))
        except (ValueError, KeyError, TypeError):
            continue
    return out


def matching(hardware: dict, model: str, dtype: str, drafts: dict[str, str], where: str | Path | None = None,
             quant: str = QUANT_NONE) -> dict[str, TuneProfile]:
    """The newest matching profile per drafter name (drafts: name -> spec). Empty: none matches,
    and the engine keeps its load-time calibration."""
    found: dict[str, TuneProfile] = {}
    for p in sorted(load_all(where), key=lambda p: p.created_at):
        for name, spec in drafts.items():
            if p.key == profile_key(hardware, model, spec, dtype, quant):
                found[name] = p
    return found
