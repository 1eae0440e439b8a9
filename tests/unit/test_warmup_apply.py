"""reconcile/warmup.apply_plan against MemoryKube: the plan's steps run in the plan's
order, and a create's Event is said only when the apiserver created the object (one that
answers it exists, as after a restart between the create and the status write, says
nothing new)."""

from __future__ import annotations

from typing import Any

from cachewarm.api import constants as c
from cachewarm.api.conditions import Cond
from cachewarm.api.events import Event
from cachewarm.reconcile.warmplan import Create, DeleteJob, DeleteService, Step, WarmPlan
from cachewarm.reconcile.warmup import apply_plan
from memkube import MemoryKube

NS = "ml"


OURS = {"apiVersion": "cachewarm.dev/v1alpha1", "kind": "CompilationCache", "name": "llama", "uid": "u-1",
        "controller": True}


def body(kind: str, name: str, owners: tuple[dict[str, Any], ...] = (OURS,)) -> dict[str, Any]:
    return {"apiVersion": "v1" if kind == "Service" else "batch/v1", "kind": kind,
            "metadata": {"name": name, "namespace": NS, "labels": {c.LABEL_WARMER_FOR: "llama"},
                         "ownerReferences": list(owners)}}


def said(name: str) -> Event:
    return Event("Normal", c.Reason.WARMER_CREATED, f"Created warmer Job {name}")


def plan(*steps: Step) -> WarmPlan:
    return WarmPlan(tuple(steps), [], Cond(c.Condition.WARMED, False, c.Reason.WARMING, ""))


def test_a_create_of_an_existing_object_says_nothing_and_a_fresh_one_says_its_event() -> None:
    kube = MemoryKube(jobs=[body("Job", "llama-cpu-old")])  # left by a reconcile that stopped before its status
    events = apply_plan(kube, NS, plan(Create(body("Job", "llama-cpu-old"), said("llama-cpu-old")),
                                       Create(body("Job", "llama-cpu-new"), said("llama-cpu-new"))))
    assert events == [said("llama-cpu-new")]
    assert [j["metadata"]["name"] for j in kube.created] == ["llama-cpu-new"]
    # Run again: both exist now, nothing is said twice.
    assert apply_plan(kube, NS, plan(Create(body("Job", "llama-cpu-new"), said("llama-cpu-new")))) == []


def test_a_create_without_an_event_says_nothing() -> None:
    kube = MemoryKube()
    assert apply_plan(kube, NS, plan(Create(body("Service", "llama-v5p16")))) == []
    assert [s["metadata"]["name"] for s in kube.services] == ["llama-v5p16"]


def test_steps_run_in_the_plans_order_and_events_keep_their_place() -> None:
    """A pool whose program changed: its old Job and Service go before the new Service and
    Job are created; the Events come back in the order the plan said them."""
    kube = MemoryKube(jobs=[body("Job", "llama-v5p16-old")], services=[body("Service", "llama-v5p16-old")])
    replaced = Event("Normal", c.Reason.WARMER_STOPPED, "Stopped warmer Job llama-v5p16-old: the program changed")
    steps: list[Step] = [replaced, DeleteJob("llama-v5p16-old"), DeleteService("llama-v5p16-old"),
                         Create(body("Service", "llama-v5p16")), Create(body("Job", "llama-v5p16-new"),
                                                                        said("llama-v5p16-new"))]
    events = apply_plan(kube, NS, plan(*steps))
    assert kube.calls == ["delete_job", "delete_service", "create", "create"]
    assert kube.deleted == [("Job", "llama-v5p16-old"), ("Service", "llama-v5p16-old")]
    assert [(o["kind"], o["metadata"]["name"]) for o in kube.created] == [("Service", "llama-v5p16"),
                                                                          ("Job", "llama-v5p16-new")]
    assert events == [replaced, said("llama-v5p16-new")]
    # The reverse plan runs in reverse: the order is the plan's, not one apply_plan imposes.
    kube = MemoryKube(jobs=[body("Job", "a")], services=[body("Service", "s")])
    apply_plan(kube, NS, plan(Create(body("Job", "b")), DeleteService("s"), DeleteJob("a")))
    assert kube.calls == ["create", "delete_service", "delete_job"]


def test_a_job_of_the_warmers_name_the_cache_does_not_control_is_said_in_the_pool_once() -> None:
    """Made without the warmer label (so never listed as the cache's, and never deleted by
    the operator), it holds the name: the create finds it, and the pool's message and one
    Warning say who must delete it; a second reconcile, whose previous status holds that
    message, says no more. The cache's own Job found the same way says nothing."""
    squatter = {"metadata": {"name": "llama-cpu-new", "namespace": NS, "labels": {}}}
    kube = MemoryKube(jobs=[squatter])
    pools = [{"name": "cpu", "job": "llama-cpu-new", "state": "Pending"}]
    warm = WarmPlan((Create(body("Job", "llama-cpu-new"), said("llama-cpu-new")),), pools,
                    Cond(c.Condition.WARMED, False, c.Reason.WARMING, ""))
    events = apply_plan(kube, NS, warm)
    assert [(e.type, e.reason) for e in events] == [("Warning", "WarmerJobNotOurs")]
    assert "Job llama-cpu-new exists and this cache is not its controller" in events[0].message
    assert pools[0]["message"] == events[0].message and kube.created == [] and kube.deleted == []
    again = [{"name": "cpu", "job": "llama-cpu-new", "state": "Pending"}]
    assert apply_plan(kube, NS, WarmPlan(warm.steps, again, warm.condition), previous=pools) == []
    assert again[0]["message"] == pools[0]["message"]
    mine = MemoryKube(jobs=[body("Job", "llama-cpu-new")])
    kept = [{"name": "cpu", "job": "llama-cpu-new", "state": "Pending"}]
    assert apply_plan(mine, NS, WarmPlan(warm.steps, kept, warm.condition)) == [] and "message" not in kept[0]
