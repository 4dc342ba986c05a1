"""The speculation policy (`gamma: auto`): per step, how many tokens each drafter proposes.

Speculation pays only when the extra tokens in a verify pass cost less than the accepted drafts
save, and that depends on the hardware (`calibrate.PassCost`, measured at load), the load (B
rows in the pass) and the live acceptance. Each step, for the rows whose γ is `auto`:

    choose γ_d per drafter d to maximise   E[tokens] / E[seconds]
    E[tokens]  = Σ_rows (1 + Σ_{j < γ_row} a_d[j])         a_d[j] = P(the first j+1 drafts accepted)
    E[seconds] = t(B, 1 + max_row γ_row) + Σ_d γ_d · s_d    t: calibrated pass cost, s_d: draft step

(rows are padded to the widest in one pass, hence the max), by coordinate ascent over drafters;
γ_d = 0 switches speculation off. Rows with a fixed γ keep it and count in the pass width.

Acceptance is estimated per drafter and draft position, starting from a prior (a cautious
0.3 per position, or what `specd tune` measured for this drafter on this machine: its profile's
per-position acceptance and draft cost, whose pass costs then stand in for the load-time
calibration, see `tune_profile.py`), from verified steps and from *shadow*
drafts: while a drafter is off, it still proposes now and then without being verified (as often
as a budget scaled to what it could gain allows), and its proposals are compared with the tokens
the target then commits (for a deterministic or coupled
draft, "the draft equals what the target emitted" is exactly "it would have been accepted").
A shadow draft costs no target time at all, and for the n-gram drafter no time at all, so the
policy can stay off where drafts are poor and notice at once when they start to pay. Model
drafters shadow only as often as a small budget of their drafting time allows. Decisions use a
lower confidence bound on acceptance (trees' too), so thin evidence never switches speculation
on. And measured throughput overrules the model: where steps that speculated realized less of
their predicted rate than steps that did not, every speculative choice is discounted by the
ratio (`discount`).

Greedy output never depends on γ. A seeded sampled request's tokens do not either: seeded rows
use coupled acceptance (`sampling.coupled_scores`, then `verify_greedy`), whose output is a
function of the seed and the position only.

Does not know: models or sequences; the engine feeds it counts and seconds.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from .calibrate import PassCost
from .schema import AUTO_MAX_GAMMA  # the most the policy proposes per step

TREE_BUDGETS = (4, 8, 16)  # token-tree node budgets the policy weighs against chains
TREE_DEPTH = 6  # the deepest tree it asks for
TREE_DRAFT_STEPS = 1.5  # until measured: drafting a tree of depth d costs about d x this many chain steps
PRIOR_ACCEPT, PRIOR_WEIGHT = 0.3, 2.0  # a cautious prior for a position never observed
# A tune profile's acceptance counts as this many observations per position: more than the cautious
# prior, so a measured profile can switch speculation on at once, and fewer than the live evidence
# holds (decayed counts approach 1 / decay = 50), so the live acceptance overrides it within a few
# dozen steps where the workload differs from the calibration prompts.
PROFILE_WEIGHT = 16.0
Z = 1.0  # one standard error below the estimate: thin evidence does not switch speculation on
# A model drafter that is off shadow-drafts within shadow_budget of the step time when speculating
# could gain this much (its `upside`) or more, within a tenth of it when it could gain nothing,
# and in proportion in between: what staying ready costs is scaled to what it can buy.
UPSIDE_FULL_BUDGET = 0.2
DISCOUNT_FADE = 0.01  # per step without speculation, the discount's evidence moves this far back to none


@dataclass
class DraftPrior:
    """What is known of a drafter before any live evidence (from a `specd tune` profile)."""
    accept: list[float]  # per draft position: P(accepted | every earlier draft accepted)
    step_s: float | None = None  # seconds per drafted position per step
    tree: dict[int, float] = field(default_factory=dict)  # tree budget -> mean accepted path length
    weight: float = PROFILE_WEIGHT  # observations the acceptance (and each tree's) counts as
    tree_row_s: dict[int, float] = field(default_factory=dict)  # tree budget -> seconds drafting one row's tree


@dataclass
class DrafterEstimate:
    prior: list[float] = field(default_factory=lambda: [PRIOR_ACCEPT] * AUTO_MAX_GAMMA)  # P(accept j | j reached)
    prior_weight: float = PRIOR_WEIGHT
    acc: list[float] = field(default_factory=lambda: [0.0] * AUTO_MAX_GAMMA)  # accepted at j (decayed)
    seen: list[float] = field(default_factory=lambda: [0.0] * AUTO_MAX_GAMMA)  # reached position j (decayed)
    step_s: float | None = None  # seconds per drafted position per step (EMA); None: not measured yet
    shadow_s: float = 0.0  # seconds of a whole shadow call (EMA): its rows, and the catch-up since the last
    gamma: int = 0  # the last choice
    steps: int = 0  # steps with rows of this drafter
    steps_on: int = 0  # of which speculated (γ > 0)
    shadow_drafts: int = 0
    verified_drafts: int = 0
    since_shadow: int = 0
    tree: int = 0  # the last choice of tree budget (0: a chain)
    tree_len: dict = field(default_factory=dict)  # budget -> [decayed accepted path length, decayed count]
    tree_row_s: dict = field(default_factory=dict)  # budget -> seconds drafting one row's tree (EMA)
    _curves: dict = field(default_factory=dict, repr=False)  # lcb -> the last accept_curve: (its inputs, it)
    # Rows asked for drafts and rows that proposed any (decayed): a lookup drafter (n-gram, suffix)
    # proposes nothing where it finds no match, and such a row gains nothing from a wider pass
    asked: float = 0.0
    proposed: float = 0.0

    def propose_rate(self) -> float:
        """P(a row asked for drafts proposes any), with a prior of 1 worth PRIOR_WEIGHT rows."""
        return (self.proposed + PRIOR_WEIGHT) / (self.asked + PRIOR_WEIGHT)

    def gain_curve(self, lcb: bool = True) -> list[float]:
        """g[j] = the expected gain of a row's (j+1)-th draft: accepted, and proposed at all."""
        rate = self.propose_rate()
        return [a * rate for a in self.accept_curve(lcb)]

    def conditional(self, j: int, lcb: bool) -> float:
        """P(accept position j | positions < j accepted): decayed counts with a prior."""
        n = self.seen[j] + self.prior_weight
        p = (self.acc[j] + self.prior[j] * self.prior_weight) / n
        return max(0.0, p - Z * math.sqrt(p * (1 - p) / n)) if lcb else p

    def accept_curve(self, lcb: bool = True) -> list[float]:
        """a[j] = P(the first j+1 drafts are all accepted). Kept until the evidence changes: the policy
        reads it several times a step, and a drafter that is off gathers none for many steps."""
        key = (self.prior_weight, *self.acc, *self.seen, *self.prior)
        got = self._curves.get(lcb)
        if got is not None and got[0] == key:
            return got[1]
        out, run = [], 1.0
        for j in range(AUTO_MAX_GAMMA):
            run *= self.conditional(j, lcb)
            out.append(run)
        self._curves[lcb] = (key, out)
        return out


class SpeculationPolicy:
    def __init__(self, cost: PassCost, decay: float = 0.02, shadow_budget: float = 0.01):
        """cost: the target's pass cost (a tune profile's, else the load-time calibration);
        decay: weight lost per observation by older evidence (tracks a changing context);
        shadow_budget: share of the step time a model drafter may spend on shadow drafts."""
        self.cost, self.decay, self.shadow_budget = cost, decay, shadow_budget
        self.priors: dict[str, DraftPrior] = {}  # drafters without one start from PRIOR_ACCEPT
        self.est: dict[str, DrafterEstimate] = {}
        self.scale = 1.0  # measured / calibrated pass time (EMA): the machine may be busier now
        self.last_pass_s, self.last_rows = cost(1, 1), 1
        # Measured throughput overrules the model: per step, realized tokens/s over the rate the
        # model predicted for its choice (EMA), for steps that speculated and steps that did not, per
        # batch size class (1, 2-3, 4-7, 8-15, ...: what the model misses, the engine's per-row work
        # for a speculative step, weighs differently at each). Where speculating realizes less of its
        # prediction than not speculating does, the predicted gain of every speculative choice at that
        # batch size is discounted by that ratio (`realized`).
        self.realized: dict[tuple[int, bool], float] = {}
        self.realized_n: dict[tuple[int, bool], float] = {}
        self._predicted: tuple[bool, float] | None = None  # the last choice: (speculated, tokens/s)
        self._predicted_class = 1  # and its batch size class

    def set_prior(self, drafter: str, prior: DraftPrior) -> None:
        """Start `drafter` from what a tune profile measured (its estimate so far is dropped)."""
        self.priors[drafter] = prior
        self.est.pop(drafter, None)

    def estimate(self, drafter: str) -> DrafterEstimate:
        if drafter not in self.est:
            e = self.est[drafter] = DrafterEstimate()
            prior = self.priors.get(drafter)
            if prior is not None:  # positions the profile did not measure keep the cautious prior
                e.prior = (list(prior.accept) + e.prior)[:AUTO_MAX_GAMMA]
                e.prior_weight, e.step_s = prior.weight, prior.step_s
                e.tree_len = {b: (length * prior.weight, prior.weight) for b, length in prior.tree.items()}
                e.tree_row_s = dict(prior.tree_row_s)
        return self.est[drafter]

    # ---- choosing ------------------------------------------------------------------------------
    def tree_for(self, drafter: str) -> int:
        """The tree budget chosen for the auto rows of this drafter on the last step (0: a chain)."""
        e = self.est.get(drafter)
        return e.tree if e is not None and e.gamma > 0 else 0

    def _tree_tokens(self, e: DrafterEstimate, budget: int, depth: int) -> float:
        """Expected accepted path length of a tree: measured, else a chain of its depth (which the
        tree contains and widens) at the chain's lower confidence bound, as chains are judged:
        thin evidence switches no tree on either (at batch 8 an unmeasured 16-node tree is a pass
        over 136 tokens)."""
        got = e.tree_len.get(budget)
        if got is not None and got[1] >= 2:
            return got[0] / got[1]
        return sum(e.accept_curve(lcb=True)[:depth]) * 1.15

    @staticmethod
    def _tree_draft_s(e: DrafterEstimate, budget: int, depth: int, rows: int) -> float:
        """Seconds to draft `rows` trees of a budget: measured per row (a tree's cost grows with
        its rows, unlike a chain step's: 5.6 / 18.8 / 36.3 ms at 1 / 4 / 8 rows for the default
        head's 4-node trees in `specd tune`), else TREE_DRAFT_STEPS x depth chain steps."""
        got = e.tree_row_s.get(budget)
        return rows * got if got is not None else TREE_DRAFT_STEPS * depth * (e.step_s or 0.0)

    def choose(self, rows: list[tuple], trees: set[str] = frozenset()) -> list[int]:
        """rows: per row of the pass (drafter or None, γ cap, auto). Returns γ per row: a fixed
        row keeps its cap; auto rows get their drafter's chosen γ (within their cap). For the
        drafters in `trees` (able to draft token trees) it also weighs trees of each budget in
        TREE_BUDGETS against chains; `tree_for` tells the choice."""
        B = len(rows)
        fixed_w = max((cap for d, cap, auto in rows if d is not None and not auto), default=0)
        groups: dict[str, list[int]] = {}
        for d, cap, auto in rows:
            if d is not None and auto and cap > 0:
                groups.setdefault(d, []).append(min(cap, AUTO_MAX_GAMMA))
        base = sum(1 + sum(self.estimate(d).accept_curve(lcb=False)[:cap]) if d is not None and not auto else 1
                   for d, cap, auto in rows)
        curves = {d: self.estimate(d).gain_curve(lcb=True) for d in groups}

        discount = self.discount(B)
        # What rate() reads, precomputed (it runs ~10 times per drafter per step): per drafter, the
        # expected tokens of its rows at each γ (their caps counted once per distinct cap), its
        # widest cap and its draft step.
        gained = {}
        for d, caps in groups.items():
            prefix = [0.0]
            for a in curves[d]:
                prefix.append(prefix[-1] + a)
            counts = {c: caps.count(c) for c in set(caps)}
            gained[d] = [sum(n * prefix[min(k, c)] for c, n in counts.items()) for k in range(max(caps) + 1)]
        widest = {d: max(caps) for d, caps in groups.items()}
        step_s = {d: self.estimate(d).step_s or 0.0 for d in groups}

        def rate(g: dict[str, int]) -> float:
            tokens = base + sum(gained[d][min(g[d], widest[d])] for d in groups)
            width = max([fixed_w] + [min(g[d], widest[d]) for d in groups])
            secs = self.scale * self.cost(B, 1 + width) + sum(g[d] * step_s[d] for d in groups)
            return tokens / secs * (discount if any(g.values()) else 1.0)

        g = {d: 0 for d in groups}
        best = rate(g)
        for _ in range(2 if len(groups) > 1 else 1):  # coordinate ascent; two rounds settle with a few drafters
            for d, caps in groups.items():
                for cand in range(0, max(caps) + 1):
                    trial = {**g, d: cand}
                    r = rate(trial)
                    if r > best * (1 + 1e-9):
                        g, best = trial, r
        chosen_tree: dict[str, int] = {}
        for d, caps in groups.items():  # would a tree beat this drafter's chain, the rest fixed?
            if d not in trees or max(caps) < 2:
                continue
            e = self.estimate(d)
            depth = min(max(caps), TREE_DEPTH)
            n_rows = len(caps)
            others = [min(g[o], max(c)) for o, c in groups.items() if o != d] + [fixed_w]
            other_tokens = base + sum(sum(curves[o][:min(g[o], c)]) for o, cs in groups.items() if o != d for c in cs)
            other_draft = sum(g[o] * (self.estimate(o).step_s or 0.0) for o in groups if o != d)
            for budget in TREE_BUDGETS:
                tokens = other_tokens + n_rows * self._tree_tokens(e, budget, depth)
                secs = (self.scale * self.cost(B, 1 + max(others + [budget])) + other_draft
                        + self._tree_draft_s(e, budget, depth, n_rows))
                if tokens / secs * discount > best * 1.02:  # a tree must pay clearly: it costs more to draft
                    best, chosen_tree[d] = tokens / secs * discount, budget
                    g[d] = depth
        on = any(g.values())
        self._predicted = (on, best / (discount if on else 1.0)) if groups else None
        self._predicted_class = B.bit_length()
        for d in groups:
            e = self.estimate(d)
            e.gamma = g[d]
            e.tree = chosen_tree.get(d, 0)
            e.steps += 1
            e.steps_on += g[d] > 0
        return [min(cap, g[d]) if d is not None and auto and d in g else (cap if d is not None else 0)
                for d, cap, auto in rows]

    def discount(self, rows: int | None = None) -> float:
        """What speculating realizes of its predicted rate, relative to not speculating, at passes of
        `rows` rows' size class (default: the last pass's) (<= 1; 1 until both have a few steps of
        evidence there)."""
        c = (self.last_rows if rows is None else rows).bit_length()
        if min(self.realized_n.get((c, True), 0.0), self.realized_n.get((c, False), 0.0)) < 3:
            return 1.0
        return min(1.0, self.realized[(c, True)] / self.realized[(c, False)])

    def observe_step(self, tokens: int, seconds: float) -> None:
        """The step `choose` last decided committed `tokens` in `seconds` (drafting and the pass)."""
        if self._predicted is None or seconds <= 0:
            return
        on, predicted = self._predicted
        self._predicted = None
        key, spec = (self._predicted_class, on), (self._predicted_class, True)
        r = min(max(tokens / seconds / predicted, 0.05), 20.0)
        self.realized[key] = r if not self.realized_n.get(key) else 0.9 * self.realized[key] + 0.1 * r
        self.realized_n[key] = 0.9 * self.realized_n.get(key, 0.0) + 1
        if not on and spec in self.realized:  # a shortfall seen while speculating fades over ~100 plain steps
            self.realized[spec] += DISCOUNT_FADE * (self.realized[key] - self.realized[spec])

    def wants_shadow(self, drafter: str, free: bool) -> bool:
        """Whether the rows of an (auto, switched-off) drafter should shadow-draft this step, within
        the shadow budget. A shadow call costs what it measured (`observe_shadow_time`): every row of
        the batch drafts (a model drafter after catching up on the tokens committed since its last
        call, so it may cost many draft steps). A lookup drafter (`free`: n-gram, suffix) costs no
        model time and shadows every step while its calls fit the budget (a 10 ms pass), and less
        often where the pass is so short that its lookups do not (a 2 ms pass over 8 rows: ~10%
        of the step, measured); a model drafter within a budget scaled to what it could gain."""
        e = self.estimate(drafter)
        if e.gamma > 0:
            return False
        e.since_shadow += 1
        if free:
            call_s, budget = e.shadow_s, self.shadow_budget
        else:
            call_s = max(AUTO_MAX_GAMMA * (e.step_s or 0.0), e.shadow_s)
            budget = self.shadow_budget * min(1.0, max(self.upside(e), 0.0) / UPSIDE_FULL_BUDGET + 0.1)
        measured = e.shadow_s if free else e.step_s
        period = 1 if not measured else math.ceil(call_s / (budget * self.scale * self.last_pass_s))
        if e.since_shadow >= period:
            e.since_shadow = 0
            return True
        return False

    def upside(self, e: DrafterEstimate) -> float:
        """The most speculating with this drafter could gain at the last pass's rows: the best γ's
        predicted rate over γ=0's, at its mean (not lower-bound) acceptance, every row drafting."""
        B = self.last_rows
        curve = e.gain_curve(lcb=False)
        off = B / (self.scale * self.cost(B, 1))
        best = max(B * (1 + sum(curve[:g])) / (self.scale * self.cost(B, 1 + g) + g * (e.step_s or 0.0))
                   for g in range(1, AUTO_MAX_GAMMA + 1))
        return best / off - 1

    # ---- learning ------------------------------------------------------------------------------
    def _observe(self, e: DrafterEstimate, drafted: int, accepted: int) -> None:
        keep = 1 - self.decay
        for j in range(min(drafted, AUTO_MAX_GAMMA)):
            if j > accepted:
                break  # never reached: the first rejection ends the block
            e.seen[j] = e.seen[j] * keep + 1
            e.acc[j] = e.acc[j] * keep + (j < accepted)

    def _observe_proposed(self, e: DrafterEstimate, proposed: bool) -> None:
        keep = 1 - self.decay
        e.asked = e.asked * keep + 1
        e.proposed = e.proposed * keep + proposed

    def observe_verified(self, drafter: str, drafted: list[int], accepted: list[int], tree: bool = False) -> None:
        """One verify step of one drafter: per row, drafts proposed and accepted (for trees:
        nodes proposed and the accepted path's length, kept apart from the chain estimate)."""
        if tree:
            self.observe_tree(drafter, drafted, accepted)
            return
        e = self.estimate(drafter)
        for k, a in zip(drafted, accepted):
            self._observe_proposed(e, k > 0)
            if k:
                self._observe(e, k, a)
                e.verified_drafts += 1

    def observe_tree(self, drafter: str, nodes: list[int], accepted: list[int]) -> None:
        """Verified token trees of one drafter: per row, nodes proposed and the accepted path's
        length, kept per budget (the smallest budget that holds the tree)."""
        e = self.estimate(drafter)
        keep = 1 - self.decay
        for n, a in zip(nodes, accepted):
            if not n:
                continue
            budget = next((b for b in TREE_BUDGETS if n <= b), TREE_BUDGETS[-1])
            tot, cnt = e.tree_len.get(budget, (0.0, 0.0))
            e.tree_len[budget] = (tot * keep + a, cnt * keep + 1)
            e.verified_drafts += 1

    def observe_shadow(self, drafter: str, drafted: int, matched: int) -> None:
        """A shadow draft of `drafted` tokens whose first `matched` equal what the target committed."""
        e = self.estimate(drafter)
        self._observe_proposed(e, drafted > 0)
        self._observe(e, drafted, matched)
        e.shadow_drafts += 1

    def observe_draft_time(self, drafter: str, width: int, seconds: float) -> None:
        """One call of a drafter that proposed up to `width` tokens per row in `seconds`."""
        if width <= 0:
            return
        e = self.estimate(drafter)
        s = seconds / width
        e.step_s = s if e.step_s is None else 0.9 * e.step_s + 0.1 * s

    def observe_tree_time(self, drafter: str, nodes: int, rows: int, seconds: float) -> None:
        """`drafter` drafted token trees for `rows` rows, the largest of `nodes` nodes, in `seconds`
        (kept per budget: the smallest that holds the tree, as `observe_tree` keeps acceptance)."""
        if rows <= 0 or nodes <= 0:
            return
        e = self.estimate(drafter)
        budget = next((b for b in TREE_BUDGETS if nodes <= b), TREE_BUDGETS[-1])
        s = seconds / rows
        old = e.tree_row_s.get(budget)
        e.tree_row_s[budget] = s if old is None else 0.9 * old + 0.1 * s

    def observe_shadow_time(self, drafter: str, seconds: float) -> None:
        """One shadow call of `drafter` (all its rows shadow-drafted) took `seconds`."""
        e = self.estimate(drafter)
        e.shadow_s = seconds if not e.shadow_s else 0.7 * e.shadow_s + 0.3 * seconds

    def observe_pass(self, rows: int, tokens: int, seconds: float) -> None:
        """A measured verify pass: keeps the calibrated costs in the machine's current units."""
        self.last_pass_s, self.last_rows = seconds, rows
        ratio = seconds / self.cost(rows, tokens)
        self.scale = 0.95 * self.scale + 0.05 * min(max(ratio, 0.2), 5.0)

    # ---- reporting -----------------------------------------------------------------------------
    def state(self) -> dict:
        return {"pass_scale": self.scale, "speculation_discount": self.discount(),
                "profiled_drafters": sorted(self.priors),
                "pass_cost_ms": {f"{b}x{t}": s * 1e3 for (b, t), s in sorted(self.cost.points.items())},
                "drafters": {d: {"gamma": e.gamma, "speculated_share": e.steps_on / e.steps if e.steps else 0.0,
                                 "steps": e.steps, "speculated_steps": e.steps_on, "accept_curve": [round(x, 3) for x in e.accept_curve(False)[:4]],
                                 "draft_step_ms": None if e.step_s is None else e.step_s * 1e3,
                                 "shadow_drafts": e.shadow_drafts, "verified_drafts": e.verified_drafts,
                                 "shadow_call_ms": e.shadow_s * 1e3,
                                 "tree": e.tree, "tree_accepted": {b: round(t / c, 3) for b, (t, c) in
                                                                    sorted(e.tree_len.items()) if c},
                                 "tree_draft_ms_per_row": {b: s * 1e3 for b, s in sorted(e.tree_row_s.items())}}
                             for d, e in self.est.items()}}


class DraftSelector:
    """`draft: auto`: which of the engine's drafts speculates for a request, chosen per request
    and re-decided as it runs — a UCB bandit over the tokens each draft earned per verify step
    for THIS request (its context), with every draft's record over all requests as the prior.
    A request reconsiders 2 and 4 steps after it started or switched, then every `period`.

    A draft's value is its mean accepted tokens per step, less its drafting time in units of a
    target pass (a model draft must earn its cost; n-gram drafting is free). Each request starts
    on the best draft so far and reconsiders every `period` steps; the UCB bonus makes it try a
    draft it has little evidence on, now and then."""

    def __init__(self, names: list[str], policy: SpeculationPolicy | None, period: int = 8, c: float = 0.6,
                 prior_weight: float = 2.0):
        self.names, self.policy, self.period, self.c, self.prior_weight = list(names), policy, period, c, prior_weight
        self.glob: dict[str, list[float]] = {n: [0.0, 0.0] for n in self.names}  # name -> [sum, count]
        self.seq: dict[int, dict[str, list[float]]] = {}
        self.steps: dict[int, int] = {}

    def _cost(self, name: str) -> float:
        if self.policy is None:
            return 0.0
        e = self.policy.est.get(name)
        return 0.0 if e is None or not e.step_s else e.step_s * max(e.gamma, 1) / max(self.policy.last_pass_s, 1e-6)

    def _value(self, key: int, name: str, bonus: bool) -> float:
        g_sum, g_n = self.glob[name]
        prior = g_sum / g_n if g_n else 0.5
        s_sum, s_n = self.seq.get(key, {}).get(name, [0.0, 0.0])
        mean = (s_sum + prior * self.prior_weight) / (s_n + self.prior_weight)
        if bonus:
            total = sum(v[1] for v in self.seq.get(key, {}).values()) + 1
            mean += self.c * math.sqrt(math.log(total + 1) / (s_n + 1))
        return mean - self._cost(name)

    def initial(self, key: int) -> str:
        self.seq[key] = {}
        self.steps[key] = 0
        return max(self.names, key=lambda n: self._value(key, n, bonus=False))

    def reconsider(self, key: int, current: str) -> str:
        n = self.steps[key] = self.steps.get(key, 0) + 1  # steps since the request's last switch
        if n not in (2, 4) and n % self.period:  # early looks after a switch, then every `period` steps
            return current
        best = max(self.names, key=lambda d: (self._value(key, d, bonus=True), d == current))
        if best != current:
            self.steps[key] = 0
        return best

    def observe(self, key: int, name: str, accepted: int) -> None:
        """One verify step of `key` drafted by `name` that had `accepted` drafts accepted."""
        s = self.seq.setdefault(key, {}).setdefault(name, [0.0, 0.0])
        s[0] += accepted
        s[1] += 1
        g = self.glob[name]
        g[0] = g[0] * 0.999 + accepted
        g[1] = g[1] * 0.999 + 1

    def release(self, key: int) -> None:
        self.seq.pop(key, None)
        self.steps.pop(key, None)
