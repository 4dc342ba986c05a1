"""The draft server and its client, without Ray: the real `DraftServer` and `RemoteDrafter` behind
a fake Serve handle (replicas in this process; a call's `.result()` runs the replica's batch).

  * a full replica answers `full` for the rows it cannot take: they run at γ=0 that step and get
    a slot later; no slot is orphaned and the batch lives (regression: propose raised after
    earlier rows took slots, the caller took the replica for dead, and after three tries the
    verifier aborted every request);
  * a replica that dies mid-run: its sequences are re-synced on another from the committed
    tokens, output unchanged;
  * state nobody asked about for `lease_s` expires (its verifier died), and a sequence that
    returns afterwards is re-synced;
  * concurrent calls are answered by ONE drafter batch, each with exactly its own rows.
"""
from __future__ import annotations

import itertools

import pytest

from actors.drafters import DraftSeq, ModelDrafter
from actors.engine import SpecEngine
from actors.llama import LlamaRunner
from cluster.draft_server import DraftServer, RemoteDrafter
from helpers import rand_tokens, request, run

MAX_LEN = 128


class Response:
    def __init__(self, fn):
        self.fn = fn

    def result(self):
        return self.fn()


class FakeHandle:
    """Stands in for a Serve DeploymentHandle to a draft deployment with several replicas:
    `options(session_id=...)` pins (PinnedRouter's rule: the pin if alive, else any live one)."""

    def __init__(self, replicas: dict[str, DraftServer], pin: str | None = None):
        self.replicas, self.pin, self.dead = replicas, pin, set()
        self.rr = itertools.cycle(sorted(replicas))
        self.propose = self.release = self  # handle.propose.remote(...), handle.release.remote(...)
        self._method = None

    def options(self, session_id=None):
        h = FakeHandle.__new__(FakeHandle)
        h.__dict__.update(self.__dict__)
        h.pin = session_id
        h.propose, h.release = _Method(h, "propose"), _Method(h, "release")
        return h

    def pick(self) -> str:
        if self.pin is not None and self.pin in self.replicas and self.pin not in self.dead:
            return self.pin
        return next(r for r in self.rr if r not in self.dead)


class _Method:
    def __init__(self, h: FakeHandle, name: str):
        self.h, self.name = h, name

    def remote(self, arg):
        rid = self.h.pick() if self.h.pin is None or self.h.pin not in self.h.dead else self.h.pin
        srv = self.h.replicas[rid]

        def call():
            if rid in self.h.dead:
                raise ConnectionError(f"replica {rid} died")
            return srv.propose_batch([arg])[0] if self.name == "propose" else srv.release(arg)
        if self.name == "release":  # fire and forget, as a Serve call runs whether awaited or not
            try:
                call()
            except ConnectionError:
                pass
        return Response(call)


def handle(replicas):
    h = FakeHandle(replicas)
    return h.options(None)


def replica(tiny, rid: str, slots: int, **kw) -> DraftServer:
    return DraftServer(ModelDrafter.truncated(tiny.model, 2, max_batch=slots, max_len=MAX_LEN), rid, **kw)


PROMPTS = [rand_tokens(n, 30 + n) for n in (6, 11, 4, 9)]


@pytest.fixture(scope="module")
def refs(tiny, hf_greedy):
    return [hf_greedy(tiny.model, p, 30, eos=None) for p in PROMPTS]


def engine(tiny, drafter) -> SpecEngine:
    return SpecEngine(LlamaRunner(tiny.model), {"remote": drafter}, max_batch=4, max_len=MAX_LEN)


def test_full_replica_rows_run_at_gamma_zero_and_nothing_is_orphaned(tiny, refs):
    rep = replica(tiny, "a", slots=2)
    rd = RemoteDrafter(handle({"a": rep}), "remote")
    eng = engine(tiny, rd)
    lens = [8, 8, 30, 30]  # r0 and r1 take both slots; r2 and r3 get them when those finish
    res = run(eng, [request(f"r{i}", p, "remote", 3, max_tokens=n) for i, (p, n) in enumerate(zip(PROMPTS, lens))])
    assert [res[f"r{i}"].token_ids for i in range(4)] == [r[:n] for r, n in zip(refs, lens)]
    assert rd.full_rows > 0  # two rows found the replica full, at first
    assert all(res[f"r{i}"].stats.draft_tokens > 0 for i in range(4))  # ... and drafted once a slot freed
    assert rep.drafter.num_active() == 0 and rep.drafter.free_capacity() == 2  # no orphaned slot
    assert rd.num_active() == 0


def test_lost_replica_is_resynced_elsewhere(tiny, refs):
    reps = {"a": replica(tiny, "a", 4), "b": replica(tiny, "b", 4)}
    h = handle(reps)
    rd = RemoteDrafter(h, "remote")
    eng = engine(tiny, rd)
    keys = {eng.add_request(request(f"r{i}", p, "remote", 3, max_tokens=30)): i for i, p in enumerate(PROMPTS)}
    out = {i: [] for i in range(4)}
    for step in itertools.count():
        if step == 4:
            h.dead.add("a")  # every call to "a" fails from now on, in flight or new
        for k, d in eng.step().items():
            out[keys[k]] += d.token_ids
        if not eng.has_work():
            break
    assert [out[i] for i in range(4)] == refs
    assert rd.resyncs > 0 and set(rd.pins.values()) <= {"b"}


def test_state_of_a_dead_verifier_expires_after_the_lease(tiny):
    now = [0.0]
    rep = replica(tiny, "a", 2, lease_s=60.0, clock=lambda: now[0])
    ctx = rand_tokens(8, 5)
    first = rep.propose_batch([[DraftSeq(seq_id=1, keep=0, new_tokens=ctx, gamma=2)]])[0]
    assert first.rows == [0] and rep.drafter.num_active() == 1
    now[0] = 61.0  # its verifier never calls again
    other = rep.propose_batch([[DraftSeq(seq_id=2, keep=0, new_tokens=ctx, gamma=2)]])[0]
    assert other.rows == [0] and rep.expired == 1 and rep.drafter.view_length(1) is None
    # had the sequence come back, it would be told to re-sync rather than served stale state
    back = rep.propose_batch([[DraftSeq(seq_id=1, keep=len(ctx) + 2, new_tokens=[7], gamma=2)]])[0]
    assert back.missing == [0] and back.proposal is None


def test_concurrent_calls_are_one_drafter_batch(tiny):
    rep = replica(tiny, "a", 4)
    calls = []
    inner = rep.drafter.propose
    rep.drafter.propose = lambda seqs: (calls.append(len(seqs)), inner(seqs))[1]
    a = [DraftSeq(seq_id=10 + i, keep=0, new_tokens=rand_tokens(5 + i, i), gamma=3) for i in range(2)]
    b = [DraftSeq(seq_id=20, keep=0, new_tokens=rand_tokens(9, 9), gamma=2)]
    ans = rep.propose_batch([a, b])
    assert calls == [3]
    solo = replica(tiny, "s", 4)
    for call, got in zip((a, b), ans):
        want = solo.propose_batch([call])[0].proposal
        assert got.proposal.num_draft == want.num_draft
        assert [got.proposal.tokens[i, :k].tolist() for i, k in enumerate(want.num_draft)] == \
            [want.tokens[i, :k].tolist() for i, k in enumerate(want.num_draft)]


# --------------------------------------------------------------------------- #
# Overlap: the next block drafted for the likeliest verdicts while the target verifies
# --------------------------------------------------------------------------- #
class SettledHandle(FakeHandle):
    """Lets the replicas finish preparing before each call, so hits do not depend on timing."""


def overlapped(tiny, layers: int, rid: str = "a", **kw) -> DraftServer:
    d = ModelDrafter.truncated(tiny.model, layers, max_batch=4, max_len=MAX_LEN)
    return DraftServer(d, rid, overlap=True, **kw)


def run_settled(eng, rep, reqs):
    keys = {eng.add_request(r): r.request_id for r in reqs}
    out = {rid: [] for rid in keys.values()}
    while eng.has_work():
        rep.settle()
        for k, d in eng.step().items():
            out[keys[k]] += d.token_ids
    return out


def test_expiry_drops_every_trace_of_an_overlapped_sequence(tiny):
    """An overlapped replica keeps a prepared block (with its branches) and an acceptance EMA per
    sequence; a sequence whose verifier died must lose all of it at the lease, not only its KV."""
    now = [0.0]
    rep = overlapped(tiny, 2, lease_s=60.0, clock=lambda: now[0])
    ctx = rand_tokens(8, 5)
    first = rep.propose_batch([[DraftSeq(seq_id=1, keep=0, new_tokens=ctx, gamma=2)]])[0]
    k = first.proposal.num_draft[0]
    rep.settle()
    rep.propose_batch([[DraftSeq(seq_id=1, keep=len(ctx) + k, new_tokens=[7], gamma=2)]])
    rep.settle()
    assert 1 in rep.alpha and 1 in rep.blocks
    now[0] = 61.0  # its verifier never calls again
    rep.propose_batch([[DraftSeq(seq_id=2, keep=0, new_tokens=ctx, gamma=2)]])
    assert rep.expired == 1 and 1 not in rep.alpha and 1 not in rep.blocks and 1 not in rep.last_seen


def test_shadow_drafts_prepare_no_next_block(tiny, refs):
    """While the speculation policy has a remote draft off, its calls are shadows: compared with
    what the target commits, never verified. Preparing the next block for their verdicts is work
    for nothing that competes with the target for the machine (the demo on a 2-core CPU: 0.92x
    with the policy off), so an overlapped replica prepares none; a verified block still is."""
    from actors.calibrate import PassCost

    rep = overlapped(tiny, 2)
    ctx = rand_tokens(8, 5)
    rep.propose_batch([[DraftSeq(seq_id=1, keep=0, new_tokens=ctx, gamma=3, shadow=True)]])
    rep.settle()
    assert 1 not in rep.blocks and rep.prepared == 0
    rep.propose_batch([[DraftSeq(seq_id=2, keep=0, new_tokens=ctx, gamma=3)]])
    rep.settle()
    assert 2 in rep.blocks and rep.prepared > 0
    # through an engine whose policy never speculates (every extra token costs a whole pass)
    rep = overlapped(tiny, 2)
    costly = PassCost({(b, t): 0.01 * t for b in (1, 4) for t in (1, 2, 5, 9)})
    eng = SpecEngine(LlamaRunner(tiny.model), {"remote": RemoteDrafter(handle({"a": rep}), "remote")},
                     max_batch=4, max_len=MAX_LEN, pass_cost=costly)
    reqs = [request(f"r{i}", p, "remote", 3, max_tokens=30) for i, p in enumerate(PROMPTS)]
    for r in reqs:
        r.speculation.gamma = "auto"
    out = run_settled(eng, rep, reqs)
    assert [out[f"r{i}"] for i in range(4)] == refs
    assert eng.policy.est["remote"].shadow_drafts > 0 and eng.policy.est["remote"].steps_on == 0
    assert rep.calls > 0 and rep.prepared == 0 and not rep.blocks


@pytest.mark.parametrize("layers", [4, 2])
def test_overlapped_drafting_is_lossless_and_hits_when_the_verdict_is_likely(tiny, refs, layers):
    """truncated:4 is the whole tiny target: every block is accepted and its bonus is the draft's
    own next token, so the prepared 'all accepted + top bonus' verdict hits on (nearly) every
    call. truncated:2 is a weak draft: fewer hits. Greedy output equals HF either way."""
    rep = overlapped(tiny, layers)
    rd = RemoteDrafter(handle({"a": rep}), "remote")
    eng = engine(tiny, rd)
    out = run_settled(eng, rep, [request(f"r{i}", p, "remote", 3, max_tokens=30) for i, p in enumerate(PROMPTS)])
    assert [out[f"r{i}"] for i in range(4)] == refs
    st = rep.stats()
    assert st["overlap"] and st["prepared_branches"] > 0
    if layers == 4:
        assert st["hit_rate"] > 0.8 and rd.prepared_rows == st["prepared_hits"]
    assert rep.drafter.num_active() == 0


def test_overlapped_sampling_keeps_seeded_tokens(tiny):
    """Coupled rows: a prepared block is the one the draft would have drafted, so a seeded
    request's tokens are the same with overlap on, off, and without a draft."""
    params = dict(max_tokens=24, temperature=0.8, seed=99)
    plain = run(engine(tiny, RemoteDrafter(handle({"a": replica(tiny, "a", 4)}), "remote")),
                [request("x", PROMPTS[1], **params)])["x"].token_ids
    rep = overlapped(tiny, 4)
    got = run_settled(engine(tiny, RemoteDrafter(handle({"a": rep}), "remote")), rep,
                      [request("x", PROMPTS[1], "remote", 3, **params)])["x"]
    assert got == plain and rep.hits > 0


def test_remote_drafts_can_be_trees(tiny, refs):
    """A remote model draft asked for token trees returns them through the draft server
    (parents and all); the replica keeps the committed view and gets the accepted path back as
    new tokens. Greedy output equals HF."""
    rep = overlapped(tiny, 2)
    rd = RemoteDrafter(handle({"a": rep}), "remote")
    eng = engine(tiny, rd)
    reqs = [request(f"r{i}", p, "remote", 4, max_tokens=30) for i, p in enumerate(PROMPTS)]
    for r in reqs[:2]:
        r.speculation.tree = 10
    out = run_settled(eng, rep, reqs)
    assert [out[f"r{i}"] for i in range(4)] == refs
    assert eng.batcher.target_passes < 4 * 29 and rep.drafter.num_active() == 0
