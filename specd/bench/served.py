"""`specd bench --serve --profile`: where a served token's time goes, per concurrency point.

Two views, taken around every timed cluster request (c1) or point (c > 1):
  verifier loop  the batcher thread's own accounting (`actors.metrics.LoopStats`, through a Serve
                 handle): per engine step, the engine's pass, prefill and drafting
                 (`BatcherStats`), and the replica's own work between steps (admitting, gauges,
                 handing deltas to the event loop) and its idle time; deltas per step
  CPU per token  CPU seconds each process of this machine's Ray session spent per generated
                 token (/proc): the verifier's batcher thread apart from its other threads (Serve's
                 event loop and Ray's streaming), the router, the Serve proxy and controller, the
                 draft replicas, Ray's own daemons and the benchmark's client
The in-process engine's accounting at c1 stands beside them. Local clusters only (/proc, and a
Serve handle from this process): `--serve` starts one. A replica the autoscaler starts or stops
inside a point counts whole (all it did and used since it started).
"""
from __future__ import annotations

import os

from .records import verifier_stats

TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _cpu_s(path: str) -> float:
    """utime + stime of a /proc stat file, in seconds."""
    with open(path) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def _role(cmd: str, me: int, pid: int) -> str | None:
    """What a process is in this Ray session, by its command line (None: not Ray's)."""
    if pid == me:
        return "client (benchmark process)"
    if cmd.startswith("ray::ServeReplica:"):
        dep = cmd.split()[0].split(":")[-1].split(".")[0]
        return {"Verifier": "verifier", "Router": "router"}.get(dep, f"replica {dep}")
    if cmd.startswith("ray::ProxyActor"):
        return "Serve proxy"
    if cmd.startswith("ray::ServeController"):
        return "Serve controller"
    if cmd.startswith("ray::"):
        return "other Ray actors"
    if "/ray/" in cmd or "ray/core/src" in cmd:
        return "Ray daemons (raylet, GCS, agents)"
    return None


class ProcessCPU:
    """CPU seconds per role of this machine's Ray processes, the verifier's batcher thread apart."""

    def __init__(self, batcher_tids: dict[int, int]):
        """batcher_tids: verifier pid -> its batcher thread's native id."""
        self.batcher_tids = batcher_tids
        self.me = os.getpid()

    def snapshot(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            pid = int(name)
            try:
                with open(f"/proc/{pid}/cmdline") as f:
                    cmd = f.read().replace("\0", " ").strip()
                role = _role(cmd, self.me, pid)
                if role is None:
                    continue
                total = _cpu_s(f"/proc/{pid}/stat")
                tid = self.batcher_tids.get(pid)
                if tid is not None:
                    batcher = _cpu_s(f"/proc/{pid}/task/{tid}/stat")
                    out["verifier: batcher thread"] = out.get("verifier: batcher thread", 0.0) + batcher
                    total -= batcher
                    role = "verifier: other threads"
            except (OSError, IndexError, ValueError):
                continue  # gone meanwhile
            out[role] = out.get(role, 0.0) + total
        return out


class ServedProfile:
    """Accumulates both views per (concurrency, mode) key over the timed requests, summed over every
    running verifier replica (each asked through a call pinned to it, as the router asks them)."""

    def __init__(self, handle, app_name: str = "specd"):
        self.handle, self.app_name = handle, app_name
        self.cpu = ProcessCPU({})
        self.points: dict[str, dict] = {}

    def _replica_ids(self) -> list[str]:
        """The running Verifier replicas' ids, from the Serve controller ([] where it cannot say)."""
        import ray
        from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

        try:
            ctrl = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
            details = ray.get(ctrl.get_serve_instance_details.remote(), timeout=30)
        except Exception:
            return []
        dep = (details.get("applications", {}).get(self.app_name) or {}).get("deployments", {}).get("Verifier", {})
        return [r["replica_id"] for r in dep.get("replicas", []) if r.get("state") == "RUNNING"]

    def _snap(self) -> tuple[dict, dict, dict]:
        ids = self._replica_ids()
        answers = [verifier_stats(self.handle.options(session_id=rid)) for rid in ids] or [verifier_stats(self.handle)]
        loop: dict[str, float] = {}
        batcher: dict[str, float] = {}
        for st in {a["replica_id"]: a for a in answers}.values():  # a pin a handle could not honour: asked twice
            for acc, part in ((loop, st["loop"]), (batcher, st["batcher"])):
                for k, v in part.items():
                    if isinstance(v, (int, float)) and not isinstance(v, bool):
                        acc[k] = acc.get(k, 0) + v
            if st.get("batcher_tid"):
                self.cpu.batcher_tids[st["pid"]] = st["batcher_tid"]
        return loop, batcher, self.cpu.snapshot()

    def around(self, key: str, fn):
        """Run fn (a timed request or point), adding what it cost to `key`'s totals; fn's result."""
        before = self._snap()
        out = fn()
        after = self._snap()
        acc = self.points.setdefault(key, {"loop": {}, "batcher": {}, "cpu": {}})
        for i, part in enumerate(("loop", "batcher", "cpu")):
            for k, v in after[i].items():
                acc[part][k] = acc[part].get(k, 0) + v - before[i].get(k, 0)
        return out

    def report(self, tokens: dict[str, int]) -> dict:
        """Per key: ms per engine step of each part of the verifier loop, and CPU ms per generated
        token of each process role. tokens: key -> tokens the clients received."""
        out = {}
        for key, acc in self.points.items():
            loop, b, cpu = acc["loop"], acc["batcher"], acc["cpu"]
            steps = max(1, loop.get("steps", 0))
            n = max(1, tokens.get(key, 0))
            per_step = {k: loop.get(k, 0.0) / steps * 1e3 for k in ("step_s", "ops_s", "gauges_s", "deliver_s",
                                                                     "idle_s")}
            per_step.update({f"engine {k}": b.get(k, 0.0) / steps * 1e3 for k in ("verify_s", "prefill_s",
                                                                                 "draft_s")})
            out[key] = {"steps": loop.get("steps", 0), "tokens": tokens.get(key, 0),
                        "tokens_per_step": tokens.get(key, 0) / steps,
                        "deltas_per_step": loop.get("deltas", 0) / steps,
                        "rows_per_pass": b.get("rows_verified", 0) / max(1, b.get("target_passes", 0)),
                        "prefilled_per_token": b.get("prefill_tokens", 0) / n,
                        "loop_ms_per_step": per_step,
                        "cpu_ms_per_token": {r: s / n * 1e3 for r, s in sorted(cpu.items(), key=lambda x: -x[1])}}
        return out


def inprocess_profile(totals: dict, tokens: int) -> dict:
    """The in-process engine's own accounting per step, from `BatcherStats` totals over its timed
    requests (and the tokens they generated)."""
    steps = max(1, totals["target_passes"])
    return {"steps": totals["target_passes"], "tokens": tokens, "tokens_per_step": tokens / steps,
            "prefilled_per_token": totals["prefill_tokens"] / max(1, tokens),
            "loop_ms_per_step": {f"engine {k}": totals[k] / steps * 1e3 for k in ("verify_s", "prefill_s", "draft_s")}}


def render(profile: dict) -> str:
    import io

    from rich.console import Console
    from rich.table import Table

    con = Console(record=True, width=150, file=io.StringIO())
    keys = list(profile)
    t = Table(title="served profile: the verifier loop, ms per engine step")
    t.add_column("part")
    for k in keys:
        t.add_column(k, justify="right")
    parts = list(dict.fromkeys(p for k in keys for p in profile[k]["loop_ms_per_step"]))
    label = {"idle_s": "idle_s (between requests, the bench's own stats calls included)"}
    for p in parts:
        t.add_row(label.get(p, p), *(f"{profile[k]['loop_ms_per_step'][p]:.2f}" if p in profile[k]["loop_ms_per_step"] else "—"
                       for k in keys))
    for label, field in (("tokens per step", "tokens_per_step"), ("stream messages per step", "deltas_per_step"),
                         ("rows per pass", "rows_per_pass"),
                         ("prompt tokens prefilled per generated token", "prefilled_per_token")):
        t.add_row(label, *(f"{profile[k][field]:.2f}" if field in profile[k] else "—" for k in keys))
    con.print(t)
    cl = [k for k in keys if "cpu_ms_per_token" in profile[k]]
    t = Table(title="served profile: CPU ms per generated token, by process (this machine)")
    t.add_column("process")
    for k in cl:
        t.add_column(k, justify="right")
    roles = list(dict.fromkeys(r for k in cl for r in profile[k]["cpu_ms_per_token"]))
    for r in roles:
        t.add_row(r, *(f"{profile[k]['cpu_ms_per_token'].get(r, 0.0):.2f}" for k in cl))
    t.add_row("all", *(f"{sum(profile[k]['cpu_ms_per_token'].values()):.2f}" for k in cl))
    con.print(t)
    return con.export_text()
