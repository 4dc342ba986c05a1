"""The wire API (protos/specd.proto) to and from the request schema (actors/schema.py).

The one place where proto messages meet the data plane's dataclasses: a
GenerateRequest becomes schema parameters (presence respected: an unset field
stays None, so `schema.validate` applies the server default), and a `Delta` or
`SpecStats` becomes a response message. The SDK keeps its own decoding (it imports
only grpcio and protobuf).
"""
from __future__ import annotations

from actors.schema import AUTO, Delta, SamplingParams, SpecStats, SpeculationParams
from protos import specd_pb2

FINISH = {"length": specd_pb2.FINISH_REASON_LENGTH, "stop": specd_pb2.FINISH_REASON_STOP,
          "abort": specd_pb2.FINISH_REASON_ABORT}


def sampling_from_proto(s: specd_pb2.SamplingParams) -> SamplingParams:
    return SamplingParams(
        max_tokens=s.max_tokens if s.HasField("max_tokens") else None,
        temperature=s.temperature if s.HasField("temperature") else 0.0,
        top_p=s.top_p if s.HasField("top_p") else 1.0,
        top_k=s.top_k, seed=s.seed if s.HasField("seed") else None, stop=tuple(s.stop),
        num_beams=s.num_beams if s.HasField("num_beams") else 1,
        length_penalty=s.length_penalty if s.HasField("length_penalty") else 1.0,
        early_stopping=s.early_stopping if s.HasField("early_stopping") else False, ignore_eos=s.ignore_eos,
        logprobs=s.logprobs if s.HasField("logprobs") else None,
        grammar=(s.grammar.kind, s.grammar.spec) if s.HasField("grammar") else None,
        presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
        repetition_penalty=s.repetition_penalty if s.HasField("repetition_penalty") else 1.0)


def speculation_from_proto(sp: specd_pb2.SpeculationParams) -> SpeculationParams:
    if sp.gamma_auto and sp.HasField("gamma"):
        raise ValueError("speculation.gamma_auto and speculation.gamma are exclusive: set one")
    return SpeculationParams(
        draft=sp.draft or None, gamma=AUTO if sp.gamma_auto else sp.gamma if sp.HasField("gamma") else None,
        tree=sp.tree if sp.HasField("tree") else None,
        threshold=sp.threshold if sp.HasField("threshold") else None,
        entropy_gate=sp.entropy_gate if sp.HasField("entropy_gate") else None,
        acceptance=sp.acceptance or "lossless")


def request_from_proto(pb: specd_pb2.GenerateRequest) -> dict:
    """`Router.request`'s keywords for a GenerateRequest: its id, parameters and its one input."""
    which = pb.WhichOneof("input")
    source = {} if which is None else {
        "prompt": {"prompt": pb.prompt},
        "messages": {"messages": [{"role": m.role, "content": m.content} for m in pb.messages.messages]},
        "token_ids": {"token_ids": list(pb.token_ids.ids)}}[which]
    return {"request_id": pb.request_id, "sampling": sampling_from_proto(pb.sampling),
            "speculation": speculation_from_proto(pb.speculation), **source}


def stats_to_proto(st: SpecStats) -> specd_pb2.SpecStats:
    msg = specd_pb2.SpecStats(drafts=st.drafts, draft_tokens=st.draft_tokens, accepted_tokens=st.accepted_tokens,
                              acceptance_rate=st.acceptance_rate, mean_accepted_length=st.mean_accepted_length,
                              target_passes=st.target_passes, draft_seconds=st.draft_s,
                              verify_seconds=st.verify_s)
    msg.acceptance_per_position.extend(st.per_position())
    return msg


def delta_to_proto(d: Delta, request_id: str, coalesced: bool) -> specd_pb2.GenerateResponse:
    """One stream message (or, with every delta joined, the unary answer)."""
    r = specd_pb2.GenerateResponse(request_id=request_id, text=d.text, token_ids=d.token_ids, coalesced=coalesced)
    for x in d.logprobs or ():
        r.logprobs.add(token_id=x.token, logprob=x.logprob,
                       top=[specd_pb2.TopLogprob(token_id=t, logprob=v) for t, v in x.top])
    if d.finished:
        r.finish_reason = FINISH[d.finish_reason]
        r.stop_string = d.stop_string
        r.usage.prompt_tokens = d.prompt_tokens
        r.usage.completion_tokens = d.completion_tokens
        if d.stats is not None:
            r.spec_stats.CopyFrom(stats_to_proto(d.stats))
    return r
