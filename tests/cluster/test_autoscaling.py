"""Autoscaling over a real local Ray Serve and real gRPC: scale up under load, drain on scale-down.

The Verifier and the remote Draft deployment autoscale independently from the config
(short delays here). Load: many concurrent streaming requests through the gRPC proxy.
Asserts, reading replica counts from `serve.status()`:
  * both deployments scale up to their maximum under load;
  * the Verifier scales back down while long requests are still streaming on BOTH of its
    replicas, so the replica being removed holds in-flight sequences: it must drain them;
  * every request, short or long, completes with the full greedy output of an unloaded run;
  * when idle, both deployments return to one replica.
Tiny random models (prompts are token ids); nothing is mocked.
"""
from __future__ import annotations

import threading
import time

import pytest
from ray import serve

from cluster.config import ClusterConfig

DRAFT = "truncated:2"
DRAFT_DEPLOYMENT = "Draft-truncated-2"
SHORT, LONG = 48, 320  # new tokens; a remote-draft LONG request streams for several seconds
FAST = {"min_replicas": 1, "max_replicas": 2, "upscale_delay_s": 1.0, "downscale_delay_s": 2.0,
        "metrics_interval_s": 0.25, "look_back_period_s": 1.0}
N_LOAD, N_LONG = 4, 2
LOAD_PROMPTS = [f"{10 + i} {20 + i} {30 + i} 7" for i in range(N_LOAD)]
LONG_PROMPTS = ["5 6 7 8 9", "11 12 13 14"]


def config() -> ClusterConfig:
    return ClusterConfig.model_validate({
        "model": "tiny", "dtype": "fp32", "max_len": 1000, "grpc_port": 0, "http_port": 0,
        "router": {"max_queue": 64, "max_tokens": LONG, "default_max_tokens": SHORT, "coalesce": False,
                   "default_draft": DRAFT},
        # total in flight / target_ongoing_requests = desired replicas: 4 -> 2, 2 long -> 1
        # Serve's least-loaded choice, so two long streams started one after the other land on both
        # replicas (prefix routing would keep them where the load phase's prompts went: test_placement.py)
        "verifier": {"max_batch": 8, "graceful_shutdown_timeout_s": 120, "routing": "power_of_two",
                     "resources": {"custom": {"large_accel": 1}},
                     "autoscaling": {**FAST, "target_ongoing_requests": N_LONG}},
        "drafts": [{"name": DRAFT, "spec": DRAFT, "placement": "remote", "default_gamma": 4, "max_batch": 32, "resources": {"custom": {"small_accel": 1}},
                    "autoscaling": {**FAST, "target_ongoing_requests": 0.75}}]})


@pytest.fixture(scope="module")
def cluster(start_cluster):
    return start_cluster(config(), timeout=90, client_timeout=180)[1]


def replicas(name: str) -> dict[str, int]:
    """{'RUNNING': n, 'STARTING': m, 'STOPPING': k, ...} for one deployment of the app."""
    dep = serve.status().applications["specd"].deployments[name]
    return {getattr(s, "value", str(s)): n for s, n in dep.replica_states.items() if n}


def wait_for(pred, timeout: float, what: str, poll: float = 0.25):
    end = time.time() + timeout
    while time.time() < end:
        got = pred()
        if got:
            return got
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}: "
                         f"Verifier {replicas('Verifier')}, Draft {replicas(DRAFT_DEPLOYMENT)}")


def test_scale_up_under_load_then_drain_on_scale_down(cluster):
    t_start = time.time()
    # Greedy references from an unloaded cluster (speculation changes nothing greedy).
    ref = {p: cluster.generate(prompt=p, max_tokens=SHORT, draft="none").token_ids for p in LOAD_PROMPTS}
    ref |= {p: cluster.generate(prompt=p, max_tokens=LONG, draft="none").token_ids for p in LONG_PROMPTS}
    assert all(len(ref[p]) == LONG for p in LONG_PROMPTS)  # none stops early at EOS
    assert replicas("Verifier") == {"RUNNING": 1} and replicas(DRAFT_DEPLOYMENT) == {"RUNNING": 1}

    # ---- load: N_LOAD concurrent streams, half of them drafting remotely --------------------------------
    stop = threading.Event()
    results: list[tuple[str, list[int]]] = []
    errors: list[BaseException] = []

    def load(i: int) -> None:
        p = LOAD_PROMPTS[i]
        while not stop.is_set():
            try:
                ids = [t for c in cluster.stream(prompt=p, max_tokens=SHORT, draft=DRAFT if i % 2 else "none",
                                                 gamma=3) for t in c.token_ids]
                results.append((p, ids))
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)
                return

    t0 = time.time()
    t_refs = t0 - t_start
    threads = [threading.Thread(target=load, args=(i,), daemon=True) for i in range(N_LOAD)]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: replicas("Verifier").get("RUNNING") == 2 and replicas(DRAFT_DEPLOYMENT).get("RUNNING") == 2,
                 150, "both deployments to scale up to 2 replicas")
    finally:
        stop.set()
        for t in threads:
            t.join(120)
    t_up = time.time() - t0
    assert not errors, errors
    assert results and all(ids == ref[p] for p, ids in results)

    # ---- drain: long streams on both verifier replicas while it scales down ------------------------------
    long_out: dict[str, list[int]] = {p: [] for p in LONG_PROMPTS}
    started = {p: threading.Event() for p in LONG_PROMPTS}
    finished: set[str] = set()

    def long_stream(p: str) -> None:
        try:
            for c in cluster.stream(prompt=p, max_tokens=LONG, draft=DRAFT, gamma=2):
                long_out[p] += c.token_ids
                started[p].set()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
        finally:
            finished.add(p)
            started[p].set()

    long_threads = [threading.Thread(target=long_stream, args=(p,), daemon=True) for p in LONG_PROMPTS]
    for t in long_threads:
        t.start()
        time.sleep(0.1)  # one at a time, so least-loaded routing spreads them over both replicas
    for p in LONG_PROMPTS:
        assert started[p].wait(60)
    verifier = serve.get_deployment_handle("Verifier", app_name="specd")
    holding: dict[str, int] = {}  # verifier replica -> sequences it holds

    def both_hold() -> bool:
        s = verifier.stats.remote().result()
        holding[s["replica_id"]] = s["active_sequences"]
        return len(holding) == 2 and all(n > 0 for n in holding.values())

    wait_for(both_hold, 20, "both verifier replicas to hold long sequences", poll=0.05)

    def scale_down_began() -> int | None:
        if replicas("Verifier").get("RUNNING", 0) < 2:
            return 1 + N_LONG - len(finished)  # 1 + long streams in flight (truthy even at 0)
        return None

    in_flight_at_scale_down = wait_for(scale_down_began, 60, "the verifier to scale down") - 1
    t_down = time.time()
    # Every long stream was still running when the scale-down began, and both replicas held some:
    # the replica being removed had in-flight sequences to drain.
    assert in_flight_at_scale_down == N_LONG, f"only {in_flight_at_scale_down} long streams left at scale-down"

    for t in long_threads:
        t.join(180)
    t_drained = time.time() - t_down
    assert not errors, errors
    for p in LONG_PROMPTS:
        assert long_out[p] == ref[p], f"long stream {p!r} lost or changed tokens across the drain"

    # ---- idle: both back to one replica, nothing left stopping ----------------------------------------
    wait_for(lambda: replicas("Verifier") == {"RUNNING": 1} and replicas(DRAFT_DEPLOYMENT) == {"RUNNING": 1},
             60, "both deployments to scale back down to 1 replica")
    # and the survivor still serves
    assert cluster.generate(prompt=LONG_PROMPTS[0], max_tokens=SHORT, draft=DRAFT).token_ids == ref[LONG_PROMPTS[0]][:SHORT]
    print(f"references {t_refs:.1f}s; scaled up in {t_up:.1f}s; {in_flight_at_scale_down} long streams in flight "
          f"at scale-down, all done {t_drained:.1f}s later; total {time.time() - t_start:.1f}s")


def test_autoscaling_config_is_what_serve_accepts():
    """Every deployment's autoscaling block becomes a valid Serve AutoscalingConfig, and the
    application passes it (with drain settings) to each deployment."""
    from ray.serve.config import AutoscalingConfig

    from cluster.app import _options

    cfg = config()
    for spec, name in ((cfg.verifier, "Verifier"), (cfg.draft(DRAFT), DRAFT_DEPLOYMENT), (cfg.router, "Router")):
        opts = _options(spec, name)
        ac = AutoscalingConfig(**opts["autoscaling_config"])
        assert (ac.min_replicas, ac.max_replicas) == (spec.autoscaling.min_replicas, spec.autoscaling.max_replicas)
        assert ac.upscale_delay_s == spec.autoscaling.upscale_delay_s
        assert opts["graceful_shutdown_timeout_s"] == spec.graceful_shutdown_timeout_s
    with pytest.raises(ValueError, match="initial_replicas"):
        ClusterConfig.model_validate({"verifier": {"autoscaling": {"min_replicas": 1, "max_replicas": 2,
                                                                   "initial_replicas": 3}}})
    with pytest.raises(ValueError, match="look_back_period_s"):
        ClusterConfig.model_validate({"verifier": {"autoscaling": {"metrics_interval_s": 2,
                                                                   "look_back_period_s": 1}}})
