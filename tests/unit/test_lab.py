"""`specd lab --quick` end to end on the tiny model: every claim gets a computed verdict, the
report names the command that reproduces it, and the figures and the JSON are written."""
import json

from specd.cli import main
from specd.lab import CLAIMS, leviathan
from specd.stats import leviathan_alpha


def test_lab_quick_writes_every_claim(tmp_path, capsys):
    assert main(["lab", "--quick", "--out", str(tmp_path)]) == 0
    report = (tmp_path / "report.md").read_text()
    res = json.loads((tmp_path / "lab.json").read_text())
    for key, title in CLAIMS:
        assert f"## {title}" in report
        assert res[key]["verdict"] and res[key]["verdict"] in report
    assert f"specd lab --quick --out {tmp_path}" in report
    for fig in ("gamma.png", "entropy.png", "threshold.png", "batching.png", "lossy.png"):
        assert (tmp_path / fig).stat().st_size > 1000
    assert res["wall_s"] < 120


def test_leviathan_formula_and_its_inverse():
    assert leviathan(0.0, 4, 0.0) == 1.0 and abs(leviathan(0.5, 1, 0.0) - 1.5) < 1e-12
    assert abs(leviathan(0.5, 4, 0.1) - (1 - 0.5 ** 5) / 0.5 / 1.4) < 1e-12
    for a in (0.1, 0.4, 0.8):
        tokens = (1 - a ** 5) / (1 - a)
        assert abs(leviathan_alpha(tokens, 4) - a) < 1e-6
