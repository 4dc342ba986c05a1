"""Distilling a draft from its target: on-policy teacher data, objectives, training, evaluation.

A run (`specd distill`):
  1. Teacher data, computed once and cached: the target's own generations (greedy
     and sampled) for a prompt corpus, or a user's texts, with the target's final
     hidden state at every position and the outputs of the decoder layers an
     EAGLE-3-style head fuses (`data_layers`). The teacher distribution at position q
     is softmax(W h_q) with W the target's LM head, so the final hidden states are
     the whole teacher signal (hidden_size numbers per token, not a vocabulary).
  2. Training a draft of one kind: an EAGLE-3-style head (fused low/mid/high target
     features), the single-layer EAGLE head, the target's first K layers, or a small
     independent model, on one objective (forward KL, reverse KL, total variation, or
     next-token cross-entropy), for a number of steps or minutes, or until held-out α
     stops rising.
  3. Held-out evaluation before and after: greedy acceptance per draft position,
     mean accepted length at γ = 1..8, draft and target step times, c, and the
     speedup the Leviathan formula predicts from them.

The target may be of any family the fast runner serves: the EAGLE head's layer starts as the
target's last layer where that maps onto it exactly, else at random with a logged line
(`drafters/eagle.py`); a truncated draft is a model of the target's own family.

Every draft may restrict its output head to the R most frequent tokens of the
training data; it can then never propose another token (the loss renormalises
the teacher over those R tokens), but each draft step is cheaper.

Does not know: serving. The checkpoint it writes loads with `--draft PATH`.
"""
from __future__ import annotations

import copy
import hashlib
import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from actors.build import DRAFT_META
from actors.calibrate import draft_step_seconds
from actors.drafters.base import KV_HEADROOM
from actors.engine import SpecEngine
from actors.llama import LlamaRunner
from actors.models import LoadedModel, cache_dir, vocab_fingerprint
from actors.schema import Request, SamplingParams
from actors.text import encode_prompt
from specd.stats import leviathan_alpha

OBJECTIVES = ("fkl", "rkl", "tv", "ntp")
KINDS = ("eagle3", "eagle", "truncated:K", "small")
GAMMAS = tuple(range(1, 9))


# ---- data -------------------------------------------------------------------------------------
@dataclass
class TeacherSeq:
    ids: list[int]
    num_prompt: int
    domain: str
    hidden: torch.Tensor  # [L, E] the target's post-norm final hidden states (target dtype)
    features: torch.Tensor | None = None  # [L, 3E] decoder layer outputs `data_layers(target)`


def eagle3_layers(num_layers: int) -> tuple[int, ...]:
    """The target features an EAGLE-3-style head fuses: a low, a middle and a high decoder
    layer (EAGLE-3's 2, L/2, L-3), plus the final hidden state, which the single-layer head
    reads: a head warm-started from one begins exactly where it was."""
    return tuple(sorted({min(2, num_layers - 1), num_layers // 2, max(num_layers - 3, 0)})) + (-1,)


def data_layers(target: LoadedModel) -> tuple[int, ...]:
    """The decoder layers whose outputs teacher data keeps (`TeacherSeq.features`)."""
    return eagle3_layers(target.model.config.num_hidden_layers)[:-1]


def head_input(s: TeacherSeq, layers: tuple[int, ...], kept: tuple[int, ...]) -> torch.Tensor:
    """A sequence's features [L, len(layers) * E] as a head reading `layers` is handed them
    (`kept`: the layers of s.features)."""
    if tuple(layers) == (-1,):
        return s.hidden
    E = s.hidden.shape[-1]
    return torch.cat([s.hidden if i == -1 else s.features[:, kept.index(i) * E:(kept.index(i) + 1) * E]
                      for i in layers], -1)


def read_corpus(path: str | Path) -> list[dict]:
    """JSONL rows with "prompt" (generated from, chat template applied), "messages", "ids" (token
    ids, generated from as they are: a pre-tokenized corpus, or a target without a tokenizer) or
    "text" (used as-is, no generation); optional "domain"."""
    rows = []
    for i, line in enumerate(Path(path).read_text().splitlines()):
        if not line.strip():
            continue
        obj = json.loads(line)
        if not any(k in obj for k in ("prompt", "messages", "ids", "text")):
            raise ValueError(f"{path}:{i + 1}: each line needs 'prompt', 'messages', 'ids' or 'text'")
        rows.append(obj)
    if not rows:
        raise ValueError(f"{path}: no rows")
    return rows


def teacher_data(target: LoadedModel, rows: list[dict], max_new: int = 128, samples: int = 1,
                 temperature: float = 0.8, seed: int = 0, batch: int = 32, progress: bool = True,
                 tag: str = "") -> list[TeacherSeq]:
    """The target's on-policy data for `rows`: per prompt its greedy continuation and `samples`
    sampled ones (different seeds), with the target's features; cached under
    ~/.cache/specd/distill by content."""
    key = hashlib.sha256(json.dumps([target.name, vocab_fingerprint(target), str(_dtype(target)), rows,
                                     max_new, samples, temperature, seed, data_layers(target)]).encode()
                         ).hexdigest()[:16]
    path = cache_dir() / "distill" / f"{tag or 'data'}-{key}.pt"
    if path.exists():
        return [TeacherSeq(**d) for d in torch.load(path, weights_only=False)]
    runner = LlamaRunner(target.model)
    eng = SpecEngine(runner, {}, tokenizer=None, eos_token_ids=target.eos_token_ids,  # no text needed
                     max_batch=batch, max_len=min(1024, runner.max_position - KV_HEADROOM))
    reqs, meta = [], []
    fixed: list[tuple[list[int], int, str]] = []  # texts: no generation
    for i, r in enumerate(rows):
        dom = r.get("domain", "general")
        if "text" in r:
            ids = target.tokenizer.encode(r["text"], add_special_tokens=False)[:1024] if target.tokenizer \
                else list(r["text"])
            fixed.append((ids, 1, dom))
            continue
        if "ids" in r:
            ids = r["ids"]
        elif "prompt" in r and getattr(target.tokenizer, "chat_template", None):
            # An instruct target sees requests through its chat template, so its data should too.
            ids = encode_prompt(target.tokenizer, messages=[{"role": "user", "content": r["prompt"]}])
        else:
            ids = encode_prompt(target.tokenizer, r.get("prompt"), r.get("messages"))
        for k in range(samples + 1):  # k = 0: greedy
            t = temperature if k else 0.0
            reqs.append(Request(f"{i}.{k}", list(ids), SamplingParams(max_tokens=max_new, temperature=t,
                                                                      seed=seed + i + 1_000_003 * max(k - 1, 0))))
            meta.append(dom)
    bar = _bar(len(reqs), "teacher generations", progress)
    keys = {eng.add_request(r): i for i, r in enumerate(reqs)}
    gen: dict[int, list[int]] = {i: [] for i in range(len(reqs))}
    while eng.has_work():
        for key, delta in eng.step().items():
            gen[keys[key]] += delta.token_ids
            bar.update(int(delta.finished))
    bar.close()
    out = list(fixed) + [(r.prompt_ids + gen[i], len(r.prompt_ids), meta[i]) for i, r in enumerate(reqs)]
    seqs = teacher_hidden(runner, out, data_layers(target), progress=progress)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save([asdict(s) for s in seqs], path)
    return seqs


def teacher_hidden(runner: LlamaRunner, seqs: list[tuple[list[int], int, str]], layers: tuple[int, ...] = (),
                   batch: int = 8, progress: bool = False) -> list[TeacherSeq]:
    """One prefill per sequence batch: the target's final hidden state at every position, and
    the outputs of decoder `layers`."""
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i][0]))
    res: dict[int, TeacherSeq] = {}
    bar = _bar(len(seqs), "teacher features", progress)
    for c in range(0, len(order), batch):
        idx = order[c:c + batch]
        lens = [len(seqs[i][0]) for i in idx]
        cache = runner.new_cache(len(idx), max(lens) + 1)
        feed = torch.zeros(len(idx), max(lens), dtype=torch.long)
        for b, i in enumerate(idx):
            feed[b, :lens[b]] = torch.tensor(seqs[i][0])
        h, f = runner.forward(cache, list(range(len(idx))), feed, lens, features=tuple(layers) + (-1,))
        for b, i in enumerate(idx):
            ids, n_prompt, dom = seqs[i]
            res[i] = TeacherSeq(list(ids), n_prompt, dom, h[b, :lens[b]].clone(),
                                f[b, :lens[b], :-h.shape[-1]].clone() if layers else None)
        bar.update(len(idx))
    bar.close()
    return [res[i] for i in range(len(seqs))]


def head_vocab(seqs: list[TeacherSeq], size: int, vocab_size: int, always: set[int]) -> torch.Tensor:
    """The `size` most frequent tokens of the data (plus `always`, e.g. EOS), sorted; all if size <= 0."""
    if size <= 0 or size >= vocab_size:
        return torch.arange(vocab_size)
    counts = torch.zeros(vocab_size)
    for s in seqs:
        counts.index_add_(0, torch.tensor(s.ids), torch.ones(len(s.ids)))
    for t in always:
        counts[t] = float("inf")
    return counts.topk(size).indices.sort().values


# ---- drafts --------------------------------------------------------------------------------------
class Student(torch.nn.Module):
    """A trainable draft of one kind, with a uniform training interface:
    predict(tokens, hidden, steps) -> list of [B, L, R] logits, step j at p predicting x_{p+j}."""

    def __init__(self, kind: str, target: LoadedModel, vmap: torch.Tensor, small_cfg: dict | None = None):
        super().__init__()
        self.kind = kind
        self.register_buffer("vmap", vmap, persistent=False)
        tm = target.model
        self.layers: tuple[int, ...] = (-1,)  # the target features the draft reads (token-level: none used)
        if kind in ("eagle", "eagle3"):
            from actors.drafters.eagle import EagleHead
            if kind == "eagle3":
                self.layers = eagle3_layers(tm.config.num_hidden_layers)
            self.head = EagleHead(tm, vmap, init=(small_cfg or {}).get("eagle_init", "last"), features=self.layers)
            self.token_level = False
        else:
            from transformers import LlamaConfig, LlamaForCausalLM
            if kind.startswith("truncated:"):
                k = int(kind.split(":", 1)[1])
                cfg = copy.deepcopy(tm.config)
                cfg.num_hidden_layers = k
                if getattr(cfg, "layer_types", None):
                    cfg.layer_types = cfg.layer_types[:k]
                self.model = type(tm)(cfg)  # the target's own family: every weight of its first K layers
                state = {n: t.detach().clone() for n, t in tm.state_dict().items()
                         if not n.startswith("model.layers.") or int(n.split(".")[2]) < k}
                self.model.load_state_dict(state)
                # The embedding and LM head stay the target's (frozen): the layers adapt.
                self.model.model.embed_tokens.weight.requires_grad_(False)
                self.model.lm_head.weight.requires_grad_(False)
            elif kind == "small":
                c = tm.config
                sc = {"hidden_size": 192, "intermediate_size": 512, "num_hidden_layers": 2,
                      "num_attention_heads": 3, "num_key_value_heads": 1,
                      **{k: v for k, v in (small_cfg or {}).items() if k != "eagle_init"}}
                cfg = LlamaConfig(vocab_size=c.vocab_size, max_position_embeddings=c.max_position_embeddings,
                                  rms_norm_eps=c.rms_norm_eps, tie_word_embeddings=True,
                                  bos_token_id=getattr(c, "bos_token_id", None),
                                  eos_token_id=getattr(c, "eos_token_id", None), **sc)
                torch.manual_seed(0)
                self.model = LlamaForCausalLM(cfg)
            else:
                raise ValueError(f"--kind must be one of {list(KINDS)}, got {kind!r}")
            self.token_level = True
        self.float()

    def predict(self, tokens: torch.Tensor, hidden: torch.Tensor, steps: int, noise: float = 0.0):
        """hidden: the target features the draft reads ([B, L, len(self.layers) * E], `head_input`)."""
        if self.token_level:
            h = self.model.model(input_ids=tokens).last_hidden_state  # [B, L, E]
            w = self.model.lm_head.weight[self.vmap]
            return [F.linear(h, w)]  # greedy drafts of a token-level model only depend on tokens
        feats = self.head.unroll(tokens, hidden.float(), steps, noise)
        return [self.head.logits(f) for f in feats], feats

    def save(self, out: Path, meta: dict) -> None:
        out.mkdir(parents=True, exist_ok=True)
        if not self.token_level:
            # a QAT head keeps fp32 weights: its int8 grid was learnt on them (bf16 would move some)
            self.head.save(out, meta, dtype=torch.float32 if meta.get("qat", "none") != "none" else torch.bfloat16)
            return
        from safetensors.torch import save_file

        m = copy.deepcopy(self.model).to(torch.bfloat16)
        for p in m.parameters():  # no shared storage left from training or the target
            p.data = p.data.clone()
        m.save_pretrained(out)
        if len(self.vmap) < m.config.vocab_size:
            save_file({"vocab_map": self.vmap.clone()}, str(out / "vocab_map.safetensors"))
        (out / DRAFT_META).write_text(json.dumps({**meta, "kind": "model"}, indent=2))


def loss_fn(objective: str, s: torch.Tensor, t: torch.Tensor, nxt: torch.Tensor, tau: float) -> torch.Tensor:
    """Per-position loss [N]: s student logits [N, R], t teacher logits [N, R] (over the same R),
    nxt the data's next token as a head row (-1 if outside the head)."""
    if objective == "ntp":
        return F.cross_entropy(s, nxt.clamp(min=0), reduction="none") * (nxt >= 0)
    ls, lt = F.log_softmax(s / tau, -1), F.log_softmax(t / tau, -1)
    if objective == "fkl":
        return (lt.exp() * (lt - ls)).sum(-1) * tau * tau
    if objective == "rkl":
        return (ls.exp() * (ls - lt)).sum(-1) * tau * tau
    if objective == "tv":
        return 0.5 * (lt.exp() - ls.exp()).abs().sum(-1)
    raise ValueError(f"--objective must be one of {list(OBJECTIVES)}, got {objective!r}")


# ---- evaluation ----------------------------------------------------------------------------------
@torch.no_grad()
def evaluate(student: Student, target: LoadedModel, seqs: list[TeacherSeq], max_gamma: int = 8,
             by_domain: bool = False) -> dict:
    """Held-out greedy acceptance: from every generated position, draft up to `max_gamma` tokens
    and count how many match the target's own greedy choice (argmax of its LM head).
    by_domain: {"all": stats, domain: stats, ...} instead of one stats dict."""
    student.eval()
    kept = data_layers(target)
    W = target.model.lm_head.weight.detach().float()
    runs: dict[str, list[int]] = {}  # accepted run length per start (capped at max_gamma), by domain
    per_seq: list[list[int]] = []  # the same, per held-out sequence (for bootstrap errors)
    for s in seqs:
        L = len(s.ids)
        if L - s.num_prompt < max_gamma + 1:
            continue
        tokens = torch.tensor(s.ids)[None]
        tgt = F.linear(s.hidden.float(), W).argmax(-1)  # [L] the target's greedy choice after each position
        h = head_input(s, student.layers, kept).float()[None]
        out = student.predict(tokens, h, max_gamma if not student.token_level else 1)
        logits = out[0]  # token-level: [B, L, R] logits; eagle: per-step list of them
        if student.token_level:
            # A token-level draft's greedy proposals depend only on tokens: while it matches,
            # its inputs are the real sequence, so step j at start p is the prediction at p+j-1.
            match = student.vmap[logits[0].argmax(-1)] == tgt  # [L]
            steps = [match[j:] for j in range(max_gamma)]
        else:
            # Step j+1 at start p drafts the token after position p+j: compare with tgt[p+j].
            steps = [student.vmap[lg[0].argmax(-1)][: L - j] == tgt[j:] for j, lg in enumerate(logits)]
        rl = runs.setdefault(s.domain, [])
        per_seq.append([])
        for p in range(s.num_prompt, L - max_gamma):
            a = 0
            while a < max_gamma and bool(steps[a][p]):
                a += 1
            rl.append(a)
            per_seq[-1].append(a)
    student.train()
    allruns = [a for r in runs.values() for a in r]
    if not by_domain:
        return _acceptance(allruns, max_gamma)
    return {"all": {**_acceptance(allruns, max_gamma), "runs_per_sequence": per_seq},
            **{d: _acceptance(r, max_gamma) for d, r in sorted(runs.items())}}


def bootstrap_alpha(*per_seq: list[list[int]], n: int = 2000, seed: int = 0) -> dict:
    """Standard errors of held-out α (Leviathan, γ=4) by bootstrap over held-out sequences:
    `per_seq` from one or more reports on the same held-out set ("runs_per_sequence"), resampled
    together (paired), so the second entry's `diff_se` is the error of α(first) − α(second)."""
    rng = random.Random(seed)
    m = len(per_seq[0])
    sums = [[(sum(min(a, 4) for a in s), len(s)) for s in runs] for runs in per_seq]

    def alpha(k: int, idx: list[int]) -> float:
        tot, cnt = (sum(x) for x in zip(*(sums[k][i] for i in idx)))
        return leviathan_alpha(1.0 + tot / max(1, cnt), 4)

    draws = []
    for _ in range(n):
        idx = [rng.randrange(m) for _ in range(m)]
        draws.append([alpha(k, idx) for k in range(len(per_seq))])

    def sd(xs: list[float]) -> float:
        mu = sum(xs) / len(xs)
        return math.sqrt(sum((x - mu) ** 2 for x in xs) / (len(xs) - 1))

    out = {"alpha": [alpha(k, list(range(m))) for k in range(len(per_seq))],
           "se": [sd([d[k] for d in draws]) for k in range(len(per_seq))]}
    if len(per_seq) > 1:
        out["diff"] = out["alpha"][0] - out["alpha"][1]
        out["diff_se"] = sd([d[0] - d[1] for d in draws])
    return out


def _acceptance(runs: list[int], max_gamma: int) -> dict:
    runs_t = torch.tensor(runs, dtype=torch.float)
    per_pos = []
    for j in range(max_gamma):
        reached = (runs_t >= j).sum().item()
        per_pos.append((runs_t >= j + 1).sum().item() / reached if reached else 0.0)
    mal = {g: 1.0 + (runs_t.clamp(max=g).mean().item() if runs else 0.0) for g in range(1, max_gamma + 1)}
    g4 = min(4, max_gamma)
    return {"positions": len(runs), "alpha_per_position": per_pos, "alpha": leviathan_alpha(mal[g4], g4),
            "accepted_at_gamma4": (mal[g4] - 1) / g4, "mean_accepted_length": mal}


def leviathan_speedup(alpha: float, gamma: int, c: float) -> float:
    e = gamma + 1 if alpha >= 1 else (1 - alpha ** (gamma + 1)) / (1 - alpha)
    return e / (gamma * c + 1)


def step_times(target: LoadedModel, drafter, ctx: int = 128, reps: int = 30) -> dict:
    """Median seconds of one target decode step and one draft step (`gamma.draft_step_seconds`)."""
    runner = LlamaRunner(target.model)
    cache = runner.new_cache(1, ctx + 64)
    ids = torch.randint(10, runner.vocab_size - 1, (1, ctx))
    runner.forward(cache, [0], ids)  # the context's KV
    tt = []
    tok = torch.tensor([[5]])
    for _ in range(reps):
        t0 = time.perf_counter()
        with torch.inference_mode():
            runner.logits(runner.forward(cache, [0], tok)[:, -1])
        tt.append(time.perf_counter() - t0)
        cache.truncate(0, ctx)
    with torch.inference_mode():
        td = draft_step_seconds(drafter, ids[0].tolist(), runner, reps=reps)
    tt = sorted(tt)[len(tt) // 2]
    return {"target_step_s": tt, "draft_step_s": td, "c": td / tt}


# ---- training ------------------------------------------------------------------------------------
@dataclass
class DistillConfig:
    kind: str = "eagle3"
    objective: str = "fkl"
    temperature: float = 1.0
    head_vocab: int = 8192  # 0: the full vocabulary
    steps: int = 800
    batch: int = 8
    max_len: int = 320  # tokens per training sequence (longer ones are cut)
    lr: float = 3e-3
    ttt_steps: int = 2  # eagle: drafting steps unrolled in training (training-time test)
    reg_weight: float = 0.1  # eagle: smooth-L1 pull of predicted features toward the target's
    noise: float = 0.05  # eagle: uniform noise on input features
    eval_every: int = 0  # 0: evaluate only before and after
    patience: int = 0  # stop once held-out α has not risen in this many evaluations (0: never)
    minutes: float = 0.0  # stop after this much training time (0: no limit); the LR schedule
    # runs over whichever of steps and minutes ends first, and with evaluations the best one is kept
    gen_only: bool = True  # score only generated positions (prompts are context)
    seed: int = 0
    small: dict = field(default_factory=dict)
    qat: str = "none"  # an int8 mode (actors/quant.py): train with its fake quantization, serve in it
    init_from: str | None = None  # start from this checkpoint of the same kind (a QAT fine-tune)


def _batches(seqs: list[TeacherSeq], cfg: DistillConfig, rng: random.Random):
    """Endless shuffled batches of similar-length sequences (less padding)."""
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i].ids))
    chunks = [order[i:i + cfg.batch] for i in range(0, len(order), cfg.batch)]
    while True:
        rng.shuffle(chunks)
        yield from chunks


def _collate(seqs: list[TeacherSeq], idx: list[int], max_len: int, vrow: torch.Tensor, gen_only: bool = True,
             layers: tuple[int, ...] = (-1,), kept: tuple[int, ...] = ()):
    """A padded batch: tokens, the final hidden states (the teacher), the draft's input features
    (`head_input`), the scored positions and the next token as a head row."""
    L = min(max_len, max(len(seqs[i].ids) for i in idx))
    B = len(idx)
    E = seqs[idx[0]].hidden.shape[-1]
    tokens = torch.zeros(B, L, dtype=torch.long)
    hidden = torch.zeros(B, L, E)
    inputs = hidden if tuple(layers) == (-1,) else torch.zeros(B, L, len(layers) * E)
    valid = torch.zeros(B, L, dtype=torch.bool)
    for b, i in enumerate(idx):
        s = seqs[i]
        n = min(L, len(s.ids))
        tokens[b, :n] = torch.tensor(s.ids[:n])
        hidden[b, :n] = s.hidden[:n].float()
        if inputs is not hidden:
            inputs[b, :n] = head_input(s, layers, kept)[:n].float()
        # Score generated positions only (prompts, with their repeated system text, stay context).
        valid[b, (s.num_prompt - 1 if gen_only else 0):n] = True
    nxt = torch.full((B, L), -1, dtype=torch.long)
    nxt[:, :-1] = torch.where(valid[:, 1:], vrow[tokens[:, 1:]], -1)
    return tokens, hidden, inputs, valid, nxt


def train(student: Student, target: LoadedModel, seqs: list[TeacherSeq], held: list[TeacherSeq],
          cfg: DistillConfig, progress: bool = True) -> dict:
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    kept = data_layers(target)
    W_R = target.model.lm_head.weight.detach().float()[student.vmap]  # [R, E] teacher rows
    vrow = torch.full((target.model.config.vocab_size,), -1, dtype=torch.long)
    vrow[student.vmap] = torch.arange(len(student.vmap))
    params = [p for p in student.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0, betas=(0.9, 0.95))
    warm = max(1, cfg.steps // 20)
    history, curve = [], []
    best = (-1.0, 0, None)  # (held-out α, step, state) of the best evaluation
    batches = _batches(seqs, cfg, rng)
    bar = _bar(cfg.steps, f"distill {student.kind} ({cfg.objective})", progress)
    t0 = time.perf_counter()
    eval_s = 0.0  # evaluations do not count against the time budget
    stop = ""
    student.train()
    for step in range(1, cfg.steps + 1):
        done = max((step - 1) / cfg.steps, (time.perf_counter() - t0 - eval_s) / (60 * cfg.minutes) if cfg.minutes
                   else 0.0)
        if done >= 1.0:
            stop = f"time budget of {cfg.minutes:g} min"
            break
        for g in opt.param_groups:  # warm-up, then a cosine over the budget
            g["lr"] = cfg.lr * min(1.0, step / warm) * 0.5 * (1 + math.cos(math.pi * done))
        tokens, hidden, inputs, valid, nxt = _collate(seqs, next(batches), cfg.max_len, vrow, cfg.gen_only,
                                                      student.layers, kept)
        t_logits = F.linear(hidden, W_R)  # [B, L, R] teacher at every position
        out = student.predict(tokens, inputs, cfg.ttt_steps, cfg.noise)
        s_logits, feats = (out, None) if student.token_level else out
        total, weight = 0.0, 0.0
        for j, sl in enumerate(s_logits):  # step j+1 at p is scored against the teacher at p+j
            L = tokens.shape[1] - j
            if L <= 0:
                break
            m = valid[:, j:]
            per = loss_fn(cfg.objective, sl[:, :L][m], t_logits[:, j:][m], nxt[:, j:][m], cfg.temperature)
            wj = 0.8 ** j
            total = total + wj * per.mean()
            if feats is not None and cfg.reg_weight > 0:
                total = total + wj * cfg.reg_weight * F.smooth_l1_loss(feats[j][:, :L][m], hidden[:, j:][m])
            weight += wj
        loss = total / weight
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        curve.append(loss.item())
        bar.update(1)
        bar.set_postfix(loss=f"{curve[-1]:.3f}")
        if cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.steps:
            te = time.perf_counter()
            ev = evaluate(student, target, held)
            eval_s += time.perf_counter() - te
            history.append({"step": step, "alpha": ev["alpha"], "alpha_1": ev["alpha_per_position"][0],
                            "seconds": time.perf_counter() - t0 - eval_s})
            bar.write(f"step {step}: held-out α {ev['alpha']:.3f} (first position {ev['alpha_per_position'][0]:.3f})")
            if ev["alpha"] > best[0]:
                best = (ev["alpha"], step, copy.deepcopy(student.state_dict()))
            elif cfg.patience and step - best[1] >= cfg.patience * cfg.eval_every:
                stop = f"held-out α not above {best[0]:.3f} (step {best[1]}) in {cfg.patience} evaluations"
                break
    bar.close()
    kept_step = len(curve)
    if best[2] is not None and cfg.eval_every:
        final = evaluate(student, target, held)["alpha"]
        if final < best[0]:  # the last state is worse than an earlier evaluation: keep that one
            student.load_state_dict(best[2])
            kept_step = best[1]
    return {"train_s": time.perf_counter() - t0 - eval_s, "loss_curve": curve, "checkpoints": history,
            "steps_run": len(curve), "kept_step": kept_step, "stopped": stop or f"{cfg.steps} steps"}


def _init_from(cfg: DistillConfig, target: LoadedModel) -> Student:
    """A student holding a `specd distill` EAGLE checkpoint's weights and head vocabulary (an
    `eagle3` student may start from a single-layer head: it then begins as that head)."""
    from actors.build import draft_meta, resolve_draft
    from actors.drafters.eagle import EagleHead

    path = resolve_draft(cfg.init_from, target.name)
    meta = draft_meta(path) or {}
    if meta.get("format"):
        raise ValueError(f"--init-from {cfg.init_from!r} is a published {meta['format']} head, whose architecture "
                         "is not specd's (serve it with --draft PATH instead)")
    if cfg.kind not in ("eagle", "eagle3") or meta.get("kind") != "eagle":
        raise ValueError(f"--init-from takes an EAGLE checkpoint for --kind eagle or eagle3; {cfg.init_from!r} is "
                         f"{meta.get('kind', 'not a specd distill checkpoint')}")
    if meta.get("vocab_fingerprint") != vocab_fingerprint(target):
        raise ValueError(f"--init-from {cfg.init_from!r} was trained for another vocabulary")
    layers = eagle3_layers(target.model.config.num_hidden_layers) if cfg.kind == "eagle3" else (-1,)
    head = EagleHead.load(path, target.model, features=layers)
    student = Student(cfg.kind, target, head.vocab_map, cfg.small)
    student.head = head
    return student.float()


def _dtype(target: LoadedModel) -> torch.dtype:
    return next(target.model.parameters()).dtype


def _bar(total: int, desc: str, enabled: bool):
    from tqdm.auto import tqdm
    return tqdm(total=total, desc=desc, disable=not enabled, dynamic_ncols=True)


# ---- one run -------------------------------------------------------------------------------------
def run(data: str | Path, heldout: str | Path, target_spec: str = "smollm2", out: str | Path = "out/draft",
        domain: str | None = None, cfg: DistillConfig | None = None, max_new: int = 128, dtype: str = "bf16",
        limit: int | None = None, progress: bool = True, samples: int = 1, data_only: bool = False) -> dict:
    """Train one draft on the corpus `data` (see `read_corpus`), evaluate it on the prompts of
    `heldout`, and write its checkpoint plus `report.json` into `out`; returns the report."""
    from actors.build import make_drafter, ready_drafter
    from actors.models import load_model

    cfg = cfg or DistillConfig()
    if cfg.objective not in OBJECTIVES:
        raise ValueError(f"--objective must be one of {list(OBJECTIVES)}, got {cfg.objective!r}")
    t_start = time.perf_counter()
    torch.manual_seed(cfg.seed)
    target = load_model(target_spec, dtype)
    rows = read_corpus(data)
    for r in rows:
        r.setdefault("domain", r.get("kind", "general"))
    if limit:
        rows = rows[:limit]
    held_rows = read_corpus(heldout)
    for r in held_rows:
        r.setdefault("domain", r.get("kind", "general"))
    t0 = time.perf_counter()
    train_seqs = teacher_data(target, rows, max_new=max_new, samples=samples, seed=cfg.seed, progress=progress,
                              tag="train")
    held = teacher_data(target, held_rows, max_new=max_new, samples=0, seed=1234, progress=progress,
                        tag="heldout")
    data_s = time.perf_counter() - t0
    if data_only:
        return {"train_sequences": len(train_seqs), "train_tokens": sum(len(s.ids) for s in train_seqs),
                "generated_tokens": sum(len(s.ids) - s.num_prompt for s in train_seqs),
                "heldout_sequences": len(held), "samples_per_prompt": samples, "data_s": data_s}
    if domain:  # the teacher data is shared by all runs on this corpus; a domain draft uses its part
        train_seqs = [s for s in train_seqs if s.domain == domain]
        if not train_seqs:
            raise ValueError(f"--domain {domain!r}: no rows of that domain in the data")
    vocab = target.model.config.vocab_size
    if cfg.init_from:
        student = _init_from(cfg, target)
        vmap = student.vmap
    else:
        vmap = head_vocab(train_seqs, cfg.head_vocab, vocab, target.eos_token_ids)
        student = Student(cfg.kind, target, vmap, cfg.small)
    coverage = _coverage(held, vmap, vocab)
    if cfg.qat != "none":
        from actors.quant import prepare_qat
        prepare_qat(student, cfg.qat)  # every trainable linear (a frozen LM head is left as it is)

    def ev() -> dict:
        return evaluate(student, target, held, by_domain=True)

    before = ev()
    tr = train(student, target, train_seqs, held, cfg, progress)
    after = ev()

    if cfg.qat != "none":
        from actors.quant import convert_qat
        convert_qat(student)
    out = Path(out)
    meta = {"name": out.name, "draft_kind": cfg.kind, "target": target.name,
            "vocab_fingerprint": vocab_fingerprint(target), "head_vocab": len(vmap),
            "config": asdict(cfg), "trained_on": str(data), "domain": domain, "qat": cfg.qat}
    student.save(out, meta)
    max_len = min(512, int(getattr(target.model.config, "max_position_embeddings", 512)) - KV_HEADROOM)
    drafter = ready_drafter(make_drafter(str(out), target, 1, max_len), str(out))  # timed as it serves (QAT: int8)
    times = step_times(target, drafter)
    g_best = max(GAMMAS, key=lambda g: leviathan_speedup(after["all"]["alpha"], g, times["c"]))
    report = {
        "target": target.name, "kind": cfg.kind, "objective": cfg.objective, "domain": domain,
        "config": asdict(cfg), "train_sequences": len(train_seqs),
        "train_tokens": sum(len(s.ids) for s in train_seqs), "heldout_sequences": len(held),
        "head_vocab": len(vmap), "heldout_token_coverage": coverage,
        "before": before, "after": after, "data_s": data_s, "train_s": tr["train_s"],
        "wall_s": time.perf_counter() - t_start, "checkpoints": tr["checkpoints"],
        "loss_first": tr["loss_curve"][:5], "loss_last": tr["loss_curve"][-5:],
        "steps_run": tr["steps_run"], "kept_step": tr["kept_step"], "stopped": tr["stopped"],
        "samples_per_prompt": samples,
        **times,
        "predicted_speedup": {g: leviathan_speedup(after["all"]["alpha"], g, times["c"]) for g in GAMMAS},
        "best_gamma": g_best, "checkpoint": str(out),
    }
    (out / "report.json").write_text(json.dumps(report, indent=2))
    return report


def _coverage(seqs: list[TeacherSeq], vmap: torch.Tensor, vocab: int) -> float:
    """Fraction of held-out generated tokens the restricted head can propose at all."""
    inside = torch.zeros(vocab, dtype=torch.bool)
    inside[vmap] = True
    gen = [t for s in seqs for t in s.ids[s.num_prompt:]]
    return inside[torch.tensor(gen)].float().mean().item() if gen else 1.0


def render(report: dict) -> str:
    """A human table: held-out α per position and mean accepted length per γ, before and after."""
    b, a = report["before"]["all"], report["after"]["all"]
    lines = [f"draft {report['kind']} ({report['objective']}, T={report['config']['temperature']}) "
             f"for {report['target']}: {report['train_sequences']} sequences / {report['train_tokens']} tokens, "
             f"{report.get('steps_run', report['config']['steps'])} steps, train {report['train_s']:.0f} s, "
             f"data {report['data_s']:.0f} s",
             f"head vocabulary {report['head_vocab']} (covers {report['heldout_token_coverage']:.1%} of held-out "
             f"generated tokens); held-out positions {a['positions']}",
             "", f"{'':24}" + "".join(f"{g:>7}" for g in GAMMAS)]
    lines.append(f"{'α per position, before':24}" + "".join(f"{x:7.3f}" for x in b["alpha_per_position"]))
    lines.append(f"{'α per position, after':24}" + "".join(f"{x:7.3f}" for x in a["alpha_per_position"]))
    lines.append(f"{'tokens/pass, before':24}" + "".join(f"{b['mean_accepted_length'][g]:7.2f}" for g in GAMMAS))
    lines.append(f"{'tokens/pass, after':24}" + "".join(f"{a['mean_accepted_length'][g]:7.2f}" for g in GAMMAS))
    lines.append(f"{'predicted speedup':24}" + "".join(f"{report['predicted_speedup'][g]:7.2f}" for g in GAMMAS))
    lines += ["", f"held-out α (Leviathan, from tokens/pass at γ=4): before {b['alpha']:.3f}, after {a['alpha']:.3f}"]
    if "stopped" in report:
        lines.append(f"trained {report['steps_run']} steps (stopped: {report['stopped']}); kept the state of step "
                     f"{report['kept_step']}; teacher data: greedy + {report['samples_per_prompt']} sampled "
                     f"continuation(s) per prompt")
    for c in report.get("checkpoints", []):
        lines.append(f"  step {c['step']:5}  {c['seconds'] / 60:5.1f} min  held-out α {c['alpha']:.3f} "
                     f"(first position {c['alpha_1']:.3f})")
    if report["config"].get("qat", "none") != "none":
        lines.append(f"QAT {report['config']['qat']}: both evaluated under that fake quantization, so 'before' is "
                     f"the {report['config'].get('init_from') or 'initial'} head quantized after training (PTQ)")
    for d, r in report["after"].items():
        if d != "all":
            lines.append(f"  {d:10} before {report['before'][d]['alpha']:.3f}  after {r['alpha']:.3f}")
    lines.append(f"draft step {report['draft_step_s'] * 1e3:.2f} ms, target step {report['target_step_s'] * 1e3:.2f} ms, "
                 f"c = {report['c']:.3f}; best γ {report['best_gamma']} -> predicted "
                 f"{report['predicted_speedup'][report['best_gamma']]:.2f}x")
    return "\n".join(lines)
