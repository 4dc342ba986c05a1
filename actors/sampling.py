"""Logit processing and the acceptance rules of speculative decoding.

This module is pure tensor code: it knows nothing about models, KV caches or
tokenizers, and it never touches global RNG state -- every random draw comes
from a ``torch.Generator`` passed in by the caller (one per request), so a
request's output is a pure function of its inputs and its generator state.

Terminology (as in vLLM's rejection sampler)
--------------------------------------------
For one row (= one request) in a verification step:

* **draft tokens** -- the ``num_draft[b]`` (at most ``G``) tokens proposed by
  the drafter (a small model or an n-gram lookup) for row ``b``.
* **accepted tokens** -- the longest prefix of the draft tokens that passes the
  acceptance rule; ``num_accepted[b]`` of them, ``0 <= num_accepted <= num_draft``.
* **recovered token** -- on the first rejection (position ``j = num_accepted``),
  a replacement token: sampled from the residual distribution
  ``norm(max(0, p_j - q_j))`` (sampled mode) or the target argmax (greedy).
* **bonus token** -- when *all* draft tokens are accepted, one extra token from
  the target's distribution at position ``num_draft`` (free, since the target
  already scored that position).

The acceptance rule (Leviathan et al. 2023, "Fast Inference from Transformers via
Speculative Decoding"; Chen et al. 2023, "Accelerating Large Language Model
Decoding with Speculative Sampling"), with target distribution ``p`` and draft
distribution ``q`` at a position::

    accept the draft x ~ q with probability min(1, p(x) / q(x));
    on rejection, emit a token sampled from norm(max(0, p - q)).

The emitted token is then distributed exactly as ``p``.

The output of a step for row ``b`` is therefore
``accepted + exactly one recovered-or-bonus token``, i.e. ``num_accepted[b] + 1``
tokens, returned as ``out_tokens[b, :num_accepted[b] + 1]`` with ``-1`` padding.

Shapes: ``B`` = rows, ``V`` = vocabulary size, ``G`` = max draft length in the
batch; target tensors carry ``G + 1`` positions (one per draft token plus the
bonus position).

Losslessness: ``process_logits`` (temperature, top-k, top-p) must be applied
identically to the draft and the target logits; the acceptance rule then makes
every emitted token distributed exactly as the *processed* target distribution.
All arithmetic is done in float32 whatever the input dtype.

Coupled sampling (seeded requests)
----------------------------------
Rejection sampling keeps the target's distribution, but *which* token comes out depends on
the draft length and the draft: a seeded request would give other tokens when the policy
chooses another γ. Seeded rows therefore use the Gumbel-max coupling instead: the token at
absolute position ``i`` of a request with seed ``s`` is ``argmax_x log p_i(x) + g_{s,i}(x)``,
where ``g_{s,i}`` is standard Gumbel noise drawn from a generator keyed by ``(s, i)``
(``gumbel_noise``). That is an exact sample from ``p_i`` (the Gumbel-max trick), and it is
the same token whatever else happens: drafters draw their drafts with the same noise
(``argmax log q_i + g_{s,i}``), so verification is exact matching on the perturbed scores
(``verify_greedy(coupled_scores(...))``). Acceptance is P(both argmaxes agree), a little below
the ``sum min(p, q)`` of rejection sampling for model drafts, equal to ``p(x)`` for a
deterministic draft ``x``.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

__all__ = ["process_logits", "verify_greedy", "verify_sampled", "sample", "gumbel_noise", "coupled_scores",
           "new_generator"]

# First candidate count tried for top-p rows (see process_logits).
_TOP_P_FIRST_K = 256


def _require(cond: bool, msg: str) -> None:
    """Precondition check that survives ``python -O`` (unlike ``assert``)."""
    if not cond:
        raise ValueError(msg)


def new_generator(device: torch.device | str) -> torch.Generator:
    """A generator on `device` (random draws happen where the tensors live). The meta device,
    used to check a step's shape and device flow without data, has none: a CPU one stands in."""
    device = torch.device(device)
    return torch.Generator() if device.type == "meta" else torch.Generator(device=device)


def _require_all(cond: torch.Tensor, msg: str) -> None:
    """A precondition on tensor values. On the CPU it is checked at once (a host read costs
    nothing there); on an accelerator it is queued with the kernels (`torch._assert_async`), so
    validation never makes the host wait for the device."""
    if cond.device.type == "cpu":
        _require(bool(cond.all()), msg)
    elif cond.device.type != "meta":
        torch._assert_async(cond.all(), msg)


def _check_generators(generators: Sequence[torch.Generator], B: int) -> None:
    _require(
        len(generators) == B,
        f"need one torch.Generator per row: got {len(generators)} generators for B={B} rows",
    )
    for i, g in enumerate(generators):
        _require(
            isinstance(g, torch.Generator),
            f"generators[{i}] must be a torch.Generator, got {type(g).__name__}",
        )


# --------------------------------------------------------------------------- #
# Logit processing
# --------------------------------------------------------------------------- #
def process_logits(
    logits: torch.Tensor,  # [B, ..., V] any float dtype, e.g. [B, V] or [B, T, V]
    temperature: torch.Tensor,  # [B] float, > 0 (greedy rows must not be passed here)
    top_k: torch.Tensor,  # [B] int64, 0 = disabled
    top_p: torch.Tensor,  # [B] float in (0, 1], 1.0 = disabled
) -> torch.Tensor:  # [B, ..., V] float32 probabilities, each row sums to 1
    """softmax(logits / T), then top-k, then top-p (nucleus) filtering, renormalised.

    Per-row parameters broadcast over the middle dimensions. Top-k keeps exactly
    ``k`` tokens (ties broken by sort order). Top-p is applied to the top-k
    renormalised distribution (HF/vLLM order) and keeps the smallest set of
    highest-probability tokens whose cumulative mass is >= ``top_p``; the top
    token is always kept. The same function must be applied to draft and target
    logits so that speculative acceptance is lossless w.r.t. this distribution.

    -inf logits are fine (probability 0); a row that is entirely -inf is not.
    """
    _require(isinstance(logits, torch.Tensor), "logits must be a tensor")
    _require(logits.is_floating_point(), f"logits must be floating point, got {logits.dtype}")
    _require(logits.dim() >= 2, f"logits must be [B, ..., V], got shape {tuple(logits.shape)}")
    B, V = logits.shape[0], logits.shape[-1]
    _require(V > 0, "logits must have a non-empty vocabulary dimension")
    for name, t in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p)):
        _require(
            isinstance(t, torch.Tensor) and tuple(t.shape) == (B,),
            f"{name} must be a tensor of shape [B]=({B},), got "
            f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}",
        )
    _require(temperature.is_floating_point(), f"temperature must be float, got {temperature.dtype}")
    _require(top_k.dtype == torch.int64, f"top_k must be int64, got {top_k.dtype}")
    _require(top_p.is_floating_point(), f"top_p must be float, got {top_p.dtype}")
    _require_all(
        temperature > 0,
        "temperature must be > 0 for every row given to process_logits "
        "(handle greedy rows with verify_greedy / argmax instead)",
    )
    _require_all(top_k >= 0, "top_k must be >= 0 (0 = disabled)")
    _require_all((top_p > 0) & (top_p <= 1), "top_p must lie in (0, 1] (1.0 = disabled)")

    bshape = (B,) + (1,) * (logits.dim() - 1)  # per-row params broadcast over [..., V]
    x = logits.float() / temperature.float().view(bshape)  # [B, ..., V]
    probs = torch.softmax(x, dim=-1)  # [B, ..., V]

    k = torch.where(top_k == 0, V, top_k).clamp(max=V)  # [B], effective k (V = no-op)
    p_thr = top_p.float()  # [B]
    use_k = k < V  # [B]
    use_p = p_thr < 1.0  # [B]
    on_host = logits.device.type == "cpu"
    if on_host and not bool((use_k | use_p).any()):
        return probs  # fast path: no filtering anywhere, no sort / top-k at all

    # Both filters only ever keep a prefix of the tokens sorted by probability, so
    # instead of sorting all V tokens (~0.5 s for 144 x 49152 on 2 CPU cores) take
    # the K largest as candidates and grow K (x8, up to V) only while some top-p
    # row's nucleus might extend beyond them. Top-k rows need K >= k. On an
    # accelerator the full sort is cheap and needs no host decision: K = V at once.
    if on_host:
        k_min = int(k[use_k].max()) if bool(use_k.any()) else 1
        K = min(V, max(k_min, _TOP_P_FIRST_K) if bool(use_p.any()) else k_min)
    else:
        K = V
    kb = k.view(bshape)  # [B, 1.., 1]
    pb = p_thr.view(bshape)  # [B, 1.., 1]
    use_pb = use_p.view(bshape)  # [B, 1.., 1]
    while True:
        cand, cand_idx = probs.topk(K, dim=-1)  # [B, ..., K] sorted descending
        rank = torch.arange(K, device=logits.device)  # [K]
        keep = rank < kb  # [B, ..., K] top-k mask
        # Top-p on the top-k renormalised distribution: the token at rank r is kept
        # iff the mass strictly before it is < top_p, giving the minimal nucleus with
        # mass >= top_p (rank 0 has no mass before it: the top token is always kept).
        in_k = cand * keep  # [B, ..., K]
        # Total top-k mass: all in the candidates when k <= K, else k == V (mass 1).
        mass_k = torch.where(kb <= K, in_k.sum(dim=-1, keepdim=True), torch.ones((), device=logits.device))
        cum = (in_k / mass_k).cumsum(dim=-1)  # [B, ..., K] normalised inclusive cumsum
        mass_before = cum - in_k / mass_k  # [B, ..., K] exclusive cumsum
        keep = keep & ((mass_before < pb) | ~use_pb)
        # A top-p row is settled once its candidates reach top_p (tokens beyond them
        # have mass_before >= top_p) or hold its whole top-k set.
        settled = ~use_pb | (cum[..., -1:] >= pb) | (kb <= K)  # [B, ..., 1]
        if K == V or bool(settled.all()):  # (K == V on an accelerator: no host read)
            break
        K = min(V, K * 8)

    filtered = torch.where(keep, cand, torch.zeros((), device=logits.device))  # [B, ..., K]
    filtered = filtered / filtered.sum(dim=-1, keepdim=True)  # renormalise
    # Write back into `probs` in place (large fresh allocations are what cost most
    # on CPU): zero the filtered rows, then scatter the kept candidates; unfiltered
    # rows get their own candidate values written back, i.e. stay unchanged.
    filtered_row = (use_k | use_p).view(bshape)  # [B, 1.., 1]
    probs.masked_fill_(filtered_row, 0.0)
    return probs.scatter_(-1, cand_idx, torch.where(filtered_row, filtered, cand))


# --------------------------------------------------------------------------- #
# Verification
# --------------------------------------------------------------------------- #
def _check_verify_args(
    target: torch.Tensor, draft_tokens: torch.Tensor, num_draft: torch.Tensor, target_name: str
) -> tuple[int, int, int]:
    _require(
        isinstance(target, torch.Tensor) and target.dim() == 3,
        f"{target_name} must be [B, G+1, V], got "
        f"{tuple(target.shape) if isinstance(target, torch.Tensor) else type(target).__name__}",
    )
    _require(target.is_floating_point(), f"{target_name} must be floating point, got {target.dtype}")
    B, G1, V = target.shape
    G = G1 - 1
    _require(G >= 0 and V > 0, f"{target_name} must be [B, G+1, V] with G+1 >= 1, V >= 1, got {tuple(target.shape)}")
    _require(
        isinstance(draft_tokens, torch.Tensor) and tuple(draft_tokens.shape) == (B, G),
        f"draft_tokens must be [B, G]=({B}, {G}) to match {target_name} {tuple(target.shape)}, got "
        f"{tuple(draft_tokens.shape) if isinstance(draft_tokens, torch.Tensor) else type(draft_tokens).__name__}",
    )
    _require(draft_tokens.dtype == torch.int64, f"draft_tokens must be int64, got {draft_tokens.dtype}")
    _require(
        isinstance(num_draft, torch.Tensor) and tuple(num_draft.shape) == (B,),
        f"num_draft must be [B]=({B},), got "
        f"{tuple(num_draft.shape) if isinstance(num_draft, torch.Tensor) else type(num_draft).__name__}",
    )
    _require(num_draft.dtype == torch.int64, f"num_draft must be int64, got {num_draft.dtype}")
    _require_all(
        (num_draft >= 0) & (num_draft <= G),
        f"num_draft must satisfy 0 <= num_draft <= G={G}",
    )
    return B, G, V


def _assemble(
    draft_tokens: torch.Tensor,  # [B, G] int64
    num_accepted: torch.Tensor,  # [B] int64
    last_token: torch.Tensor,  # [B] int64, recovered-or-bonus token
) -> torch.Tensor:  # [B, G+1] int64, -1 padded
    B, G = draft_tokens.shape
    pos = torch.arange(G, device=draft_tokens.device)  # [G]
    out = torch.full((B, G + 1), -1, dtype=torch.int64, device=draft_tokens.device)
    out[:, :G] = torch.where(pos < num_accepted[:, None], draft_tokens, -1)
    out.scatter_(1, num_accepted[:, None], last_token[:, None])
    return out


def _num_accepted(accept: torch.Tensor, num_draft: torch.Tensor) -> torch.Tensor:
    """Length of the all-True prefix of ``accept`` [B, G] within ``num_draft`` [B] -> [B]."""
    G = accept.shape[1]
    valid = torch.arange(G, device=accept.device) < num_draft[:, None]  # [B, G]
    return (accept & valid).long().cumprod(dim=1).sum(dim=1)  # cumprod trick


def verify_greedy(
    target_logits: torch.Tensor,  # [B, G+1, V] any float dtype (raw or processed)
    draft_tokens: torch.Tensor,  # [B, G] int64, entries >= num_draft[b] are garbage
    num_draft: torch.Tensor,  # [B] int64, 0 <= num_draft <= G
) -> tuple[torch.Tensor, torch.Tensor]:  # num_accepted [B] int64, out_tokens [B, G+1] int64
    """Greedy verification: accept the longest prefix where draft == target argmax.

    ``out_tokens[b, :n] = draft_tokens[b, :n]`` with ``n = num_accepted[b]`` and
    ``out_tokens[b, n] = argmax(target_logits[b, n])`` -- the recovered token on a
    mismatch, or the bonus token when all drafts matched. The rest is ``-1``.
    """
    B, G, V = _check_verify_args(target_logits, draft_tokens, num_draft, "target_logits")
    target_argmax = target_logits.argmax(dim=-1)  # [B, G+1]
    match = draft_tokens == target_argmax[:, :G]  # [B, G]
    num_accepted = _num_accepted(match, num_draft)  # [B]
    last = target_argmax.gather(1, num_accepted[:, None]).squeeze(1)  # [B]
    return num_accepted, _assemble(draft_tokens, num_accepted, last)


def verify_sampled(
    target_probs: torch.Tensor,  # [B, G+1, V] float, processed with process_logits
    draft_probs: Optional[torch.Tensor],  # [B, G, V] float processed the same way, or None
    draft_tokens: torch.Tensor,  # [B, G] int64, entries >= num_draft[b] are garbage
    num_draft: torch.Tensor,  # [B] int64, 0 <= num_draft <= G
    generators: Sequence[torch.Generator],  # len B, one per row/request
) -> tuple[torch.Tensor, torch.Tensor]:  # num_accepted [B] int64, out_tokens [B, G+1] int64
    """Speculative rejection sampling (Leviathan et al. 2023; Chen et al. 2023).

    ``draft_probs=None`` means a deterministic drafter (e.g. n-gram lookup): ``q``
    is one-hot at the draft token, so a draft ``x`` is accepted with probability
    ``p(x)`` and the residual is ``p`` with ``x`` removed.

    Randomness contract: row ``b`` draws exactly ``G`` uniforms
    (``torch.rand(G, generator=generators[b])``) and then exactly one
    ``torch.multinomial`` sample, whatever happens. Outputs are therefore a pure
    function of (inputs, generator states), and a row's output does not depend
    on the other rows -- given the same batch-wide ``G``. Generators must live on
    the device of ``target_probs``.
    """
    B, G, V = _check_verify_args(target_probs, draft_tokens, num_draft, "target_probs")
    if draft_probs is not None:
        _require(
            isinstance(draft_probs, torch.Tensor) and tuple(draft_probs.shape) == (B, G, V),
            f"draft_probs must be [B, G, V]=({B}, {G}, {V}) or None, got "
            f"{tuple(draft_probs.shape) if isinstance(draft_probs, torch.Tensor) else type(draft_probs).__name__}",
        )
        _require(draft_probs.is_floating_point(), f"draft_probs must be floating point, got {draft_probs.dtype}")
    _check_generators(generators, B)
    device = target_probs.device

    p = target_probs.float()  # [B, G+1, V]
    q = draft_probs.float() if draft_probs is not None else None  # [B, G, V] or None
    pos = torch.arange(G, device=device)  # [G]
    valid = pos < num_draft[:, None]  # [B, G]
    _require_all(
        ((draft_tokens >= 0) & (draft_tokens < V)) | ~valid,
        f"draft_tokens within num_draft must lie in [0, V={V})",
    )
    tok = torch.where(valid, draft_tokens, 0)  # [B, G] safe gather index

    # One uniform per draft position per row, from that row's own generator.
    u = torch.stack(
        [torch.rand(G, generator=g, device=device) for g in generators]
    ) if B > 0 else torch.empty(0, G, device=device)  # [B, G]

    # Acceptance rule: accept x ~ q with probability min(1, p(x) / q(x)), i.e.
    #   u < min(1, p(x)/q(x))  <=>  u * q(x) < p(x)   (u in [0, 1)),
    # written without the division: q(x) = 0 < p(x) accepts, p(x) = 0 rejects.
    p_x = p[:, :G].gather(-1, tok[..., None]).squeeze(-1)  # [B, G]
    q_x = q.gather(-1, tok[..., None]).squeeze(-1) if q is not None else torch.ones_like(p_x)  # [B, G]
    accept = u * q_x < p_x  # [B, G]
    num_accepted = _num_accepted(accept, num_draft)  # [B]

    # Distribution of the final token, at position j = num_accepted[b]:
    #   rejected at j (j < num_draft): residual norm(max(0, p_j - q_j));
    #                                  if it has no mass (only when p_j == q_j) use p_j
    #   all accepted (j == num_draft): bonus from p_j.
    rows = torch.arange(B, device=device)
    p_j = p[rows, num_accepted]  # [B, V]
    if G > 0:
        j_q = num_accepted.clamp(max=G - 1)  # [B] (clamped rows are bonus rows; unused)
        if q is not None:
            q_j = q[rows, j_q]  # [B, V]
        else:
            q_j = torch.nn.functional.one_hot(tok[rows, j_q], V).float()  # [B, V]
        residual = (p_j - q_j).clamp(min=0)  # [B, V]
        residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_j)
        rejected = num_accepted < num_draft  # [B]
        final_dist = torch.where(rejected[:, None], residual, p_j)  # [B, V], unnormalised is fine
    else:
        final_dist = p_j
    last = sample(final_dist, generators)  # [B]; multinomial normalises
    return num_accepted, _assemble(draft_tokens, num_accepted, last)


def sample(
    probs: torch.Tensor,  # [B, V] float, non-negative, each row with positive mass
    generators: Sequence[torch.Generator],  # len B, one per row/request
) -> torch.Tensor:  # [B] int64
    """One multinomial draw per row from ``probs[b]`` using ``generators[b]``.

    Used for the first token after prefill, for draft-model sampling and for the
    recovered/bonus token of ``verify_sampled``. Rows need not be normalised.
    """
    _require(
        isinstance(probs, torch.Tensor) and probs.dim() == 2,
        f"probs must be [B, V], got "
        f"{tuple(probs.shape) if isinstance(probs, torch.Tensor) else type(probs).__name__}",
    )
    _require(probs.is_floating_point(), f"probs must be floating point, got {probs.dtype}")
    B = probs.shape[0]
    _check_generators(generators, B)
    if B == 0:
        return torch.empty(0, dtype=torch.int64, device=probs.device)
    pf = probs.float()
    return torch.cat([torch.multinomial(pf[b], 1, generator=g) for b, g in enumerate(generators)])


# --------------------------------------------------------------------------- #
# Coupled (Gumbel-max) sampling
# --------------------------------------------------------------------------- #
_MASK64 = (1 << 64) - 1


def _key(seed: int, position: int) -> int:
    """splitmix64 of (seed, position): a generator seed per request position, < 2**63."""
    z = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def gumbel_noise(
    seed: int,
    positions: Sequence[int],  # absolute token positions in the request (prompt included)
    vocab: int,
    device: torch.device | str = "cpu",
    generator: Optional[torch.Generator] = None,  # reused (re-seeded per position) if given
) -> torch.Tensor:  # [len(positions), vocab] float32 standard Gumbel noise
    """Noise keyed by (seed, position) only: the same numbers for the same request position,
    whatever the batch, the draft length or the process that draws them."""
    g = generator if generator is not None else new_generator(device)
    out = torch.empty(len(positions), vocab, device=device)
    tiny = torch.finfo(torch.float32).tiny
    for i, pos in enumerate(positions):
        g.manual_seed(_key(seed, pos))
        out[i] = torch.rand(vocab, generator=g, device=device)
    return -torch.log(-torch.log(out.clamp_(min=tiny, max=1 - 1e-7)))


def coupled_scores(
    probs: torch.Tensor,  # [..., V] processed probabilities (process_logits), zeros = filtered out
    noise: torch.Tensor,  # [..., V] gumbel_noise for the same positions
) -> torch.Tensor:  # [..., V] float32; argmax = the coupled sample, -inf where probs == 0
    """log p + g: its argmax is an exact sample from p (the Gumbel-max trick)."""
    return torch.log(probs.float()) + noise
