"""The wire API: protos/specd.proto and its committed, generated stubs.

* Drift: the committed stubs must equal what `make protos` (protos/regen.py)
  generates from the committed .proto; `regen.py --check` is proven to catch
  both an edited .proto and a hand-edited stub, on a copy in a temp dir.
* Shape: services/methods/streaming, package-qualified imports, field presence.
* Round trips of the main messages through bytes.
* Every field and enum value in the .proto is documented by a comment.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from protos import specd_pb2, specd_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
REGEN = ROOT / "protos" / "regen.py"
FILES = ["specd.proto", "specd_pb2.py", "specd_pb2.pyi", "specd_pb2_grpc.py"]


def run_regen(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REGEN), *args], capture_output=True, text=True, timeout=60)


@pytest.fixture
def tree(tmp_path):
    """A copy of protos/ (proto + committed stubs) in a temp repo root."""
    (tmp_path / "protos").mkdir()
    for name in FILES:
        shutil.copyfile(ROOT / "protos" / name, tmp_path / "protos" / name)
    return tmp_path


def test_committed_stubs_match_proto():
    """Fails on drift: run `make protos` and commit the regenerated stubs."""
    proc = run_regen("--check")
    assert proc.returncode == 0, proc.stderr + proc.stdout


def test_check_detects_a_changed_proto(tree):
    assert run_regen("--check", "--root", str(tree)).returncode == 0  # the untouched copy is in sync
    proto = tree / "protos" / "specd.proto"
    text = proto.read_text()
    anchor = "  uint32 completion_tokens = 2;\n"
    assert anchor in text
    proto.write_text(text.replace(anchor, anchor + "  // drift\n  uint32 cached_tokens = 3;\n"))
    proc = run_regen("--check", "--root", str(tree))
    assert proc.returncode == 1
    assert "protos/specd_pb2.py" in proc.stderr and "protos/specd_pb2.pyi" in proc.stderr
    assert "make protos" in proc.stderr
    # regenerating in place fixes it, and the new field reaches the stubs
    assert run_regen("--root", str(tree)).returncode == 0
    assert run_regen("--check", "--root", str(tree)).returncode == 0
    assert "cached_tokens" in (tree / "protos" / "specd_pb2.pyi").read_text()


def test_check_detects_a_hand_edited_stub(tree):
    stub = tree / "protos" / "specd_pb2_grpc.py"
    stub.write_text(stub.read_text().replace("'/specd.v1.SpecDecode/Generate'", "'/specd.v1.SpecDecode/Gen'"))
    proc = run_regen("--check", "--root", str(tree))
    assert proc.returncode == 1
    assert "protos/specd_pb2_grpc.py" in proc.stderr and "specd_pb2.py:" not in proc.stderr


def test_check_detects_a_missing_stub(tree):
    (tree / "protos" / "specd_pb2.pyi").unlink()
    proc = run_regen("--check", "--root", str(tree))
    assert proc.returncode == 1 and "missing" in proc.stderr


def test_stubs_are_package_qualified_and_service_shape():
    assert specd_pb2.DESCRIPTOR.name == "protos/specd.proto"
    assert specd_pb2.DESCRIPTOR.package == "specd.v1"
    assert "from protos import specd_pb2" in Path(specd_pb2_grpc.__file__).read_text()
    svc = specd_pb2.DESCRIPTOR.services_by_name["SpecDecode"]
    methods = {m.name: m for m in svc.methods}
    assert set(methods) == {"Generate", "GenerateStream", "GetStats", "ListModels", "Abort", "GetLoad"}
    assert methods["GenerateStream"].server_streaming and not methods["GenerateStream"].client_streaming
    assert not methods["Generate"].server_streaming
    assert methods["Generate"].input_type.name == methods["GenerateStream"].input_type.name == "GenerateRequest"
    assert methods["GetStats"].output_type.name == "StatsResponse"
    assert methods["ListModels"].output_type.name == "ListModelsResponse"
    # proto3 `optional` exactly where unset must differ from 0
    def optional(msg):  # scalar fields with presence outside a real oneof
        return {f.name for f in msg.DESCRIPTOR.fields if f.has_presence and f.message_type is None
                and (f.containing_oneof is None or f.containing_oneof.name.startswith("_"))}
    assert optional(specd_pb2.SamplingParams) == {"max_tokens", "temperature", "top_p", "seed", "num_beams",
                                                  "length_penalty", "early_stopping", "logprobs",
                                                  "repetition_penalty"}
    assert optional(specd_pb2.SpeculationParams) == {"gamma", "threshold", "entropy_gate", "tree"}
    assert specd_pb2.SamplingParams.DESCRIPTOR.fields_by_name["seed"].type == \
        specd_pb2.SamplingParams.DESCRIPTOR.fields_by_name["seed"].TYPE_UINT64
    assert [v.name for v in specd_pb2.FinishReason.DESCRIPTOR.values] == [
        "FINISH_REASON_UNSPECIFIED", "FINISH_REASON_LENGTH", "FINISH_REASON_STOP", "FINISH_REASON_ABORT"]


def test_generate_request_round_trip():
    req = specd_pb2.GenerateRequest(
        request_id="r1",
        messages=specd_pb2.ChatMessages(messages=[specd_pb2.ChatMessage(role="system", content="be brief"),
                                                  specd_pb2.ChatMessage(role="user", content="héllo ✓")]),
        sampling=specd_pb2.SamplingParams(max_tokens=64, temperature=0.0, top_k=40, seed=2**63 + 5,
                                          stop=["\n\n", "END"]),
        speculation=specd_pb2.SpeculationParams(draft="truncated:4", gamma=0))
    back = specd_pb2.GenerateRequest.FromString(req.SerializeToString())
    assert back == req
    assert back.WhichOneof("input") == "messages"
    assert [(m.role, m.content) for m in back.messages.messages] == [("system", "be brief"), ("user", "héllo ✓")]
    s = back.sampling
    assert s.HasField("temperature") and s.temperature == 0.0  # explicit greedy, distinguishable from unset
    assert not s.HasField("top_p") and s.top_p == 0.0  # unset -> server applies 1.0
    assert s.seed == 2**63 + 5 and list(s.stop) == ["\n\n", "END"]
    assert back.speculation.HasField("gamma") and back.speculation.gamma == 0  # explicit "speculation off"

    bare = specd_pb2.GenerateRequest.FromString(specd_pb2.GenerateRequest(prompt="hi").SerializeToString())
    assert bare.WhichOneof("input") == "prompt" and bare.prompt == "hi"
    assert not bare.HasField("sampling") and not bare.HasField("speculation")
    assert not bare.sampling.HasField("seed") and not bare.speculation.HasField("gamma")
    assert bare.speculation.draft == ""  # server default draft
    # the oneof: setting messages clears prompt
    bare.messages.messages.add(role="user", content="x")
    assert bare.WhichOneof("input") == "messages" and bare.prompt == ""


def test_generate_response_and_stats_round_trip():
    final = specd_pb2.GenerateResponse(
        request_id="r1", text=" world", token_ids=[3, 70000, 2**32 - 1],
        finish_reason=specd_pb2.FINISH_REASON_STOP,
        usage=specd_pb2.Usage(prompt_tokens=12, completion_tokens=9),
        spec_stats=specd_pb2.SpecStats(drafts=3, draft_tokens=12, accepted_tokens=6, acceptance_rate=0.5,
                                       mean_accepted_length=3.0, acceptance_per_position=[0.75, 0.5, 0.25],
                                       target_passes=4, draft_seconds=0.01, verify_seconds=0.2),
        coalesced=True)
    back = specd_pb2.GenerateResponse.FromString(final.SerializeToString())
    assert back == final and list(back.token_ids) == [3, 70000, 2**32 - 1]
    assert list(back.spec_stats.acceptance_per_position) == [0.75, 0.5, 0.25]
    delta = specd_pb2.GenerateResponse.FromString(
        specd_pb2.GenerateResponse(request_id="r1", text="Hel", token_ids=[1]).SerializeToString())
    assert delta.finish_reason == specd_pb2.FINISH_REASON_UNSPECIFIED
    assert not delta.HasField("usage") and not delta.HasField("spec_stats") and not delta.coalesced

    stats = specd_pb2.StatsResponse(
        requests_total=10, requests_active=2, requests_queued=1, coalesced_total=3, rejected_total=1,
        tokens_total=500, spec_stats=specd_pb2.SpecStats(drafts=5), uptime_seconds=12.5,
        replicas=[specd_pb2.ReplicaStats(replica_id="a", role="verifier", active_sequences=2,
                                         kv_slots_in_use=2, kv_slots_total=8)])
    assert specd_pb2.StatsResponse.FromString(stats.SerializeToString()) == stats
    models = specd_pb2.ListModelsResponse(
        target="smollm2", max_gamma=16, max_tokens=2048, context_length=8192,
        drafts=[specd_pb2.DraftInfo(name="none", kind="none"),
                specd_pb2.DraftInfo(name="ngram", kind="ngram", default=True, default_gamma=4)])
    back = specd_pb2.ListModelsResponse.FromString(models.SerializeToString())
    assert back == models and [d.name for d in back.drafts if d.default] == ["ngram"]


def test_every_field_is_commented():
    """Each field / enum value / rpc in the .proto has a `//` comment on the line(s) above it."""
    lines = (ROOT / "protos" / "specd.proto").read_text().splitlines()
    decl = re.compile(r"^\s+(?:(?:optional|repeated)\s+)?[\w.]+\s+\w+\s*=\s*\d+;|^\s+[A-Z_0-9]+\s*=\s*\d+;|^\s+rpc\s")
    undocumented, seen = [], 0
    for i, line in enumerate(lines):
        if decl.match(line):
            seen += 1
            j = i - 1
            while j >= 0 and not lines[j].strip():
                j -= 1
            if not lines[j].strip().startswith("//"):
                undocumented.append(f"line {i + 1}: {line.strip()}")
    assert seen >= 60  # the pattern really matches the declarations (4 rpcs, 4 enum values, 50+ fields)
    assert not undocumented, "undocumented proto declarations:\n" + "\n".join(undocumented)
