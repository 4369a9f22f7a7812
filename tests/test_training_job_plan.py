"""A leader's job plan document, read once into a JobPlan value."""

from __future__ import annotations

from p2pswarm.agent.training.job_plan import JobPlan
from p2pswarm.agent.training.jobs import card_key, job_plan, model_message
from p2pswarm.planner import cluster_from_dict, plan_message
from p2pswarm.planner.plan import Plan
from p2pswarm.training.job import JobConfig


def test_a_job_plan_reads_back_what_its_replicas_planned() -> None:
    view = cluster_from_dict({"fellows": [
        {"id": f"{i:02x}", "name": f"fellow-{i + 1}", "cards": [
            {"index": 0, "kind": "cpu", "name": "CPU", "total_bytes": "16GB",
             "free_bytes": "16GB"}]} for i in range(2)]})
    job = JobConfig.from_dict({"model": "tiny-llama", "steps": 4, "seq_len": 32,
                               "micro_batch": 2, "micro_batches": 3})
    doc = plan_message({"model": model_message(job), **job.plan_request(),
                        "stages": 2}, view)
    plan = Plan.from_doc(doc)
    assert plan.to_dict() == doc and list(plan.to_dict()) == list(doc)  # the same document
    shown = job_plan(job, [plan])
    assert {k: v for k, v in shown.items() if k not in ("replicas", "job")} == doc
    assert shown["replicas"][0]["stages"] == doc["stages"]
    assert shown["replicas"][0]["request"] == doc["request"]
    read = JobPlan.from_doc(shown)
    assert (read.plan_id, read.fits, read.auto_batch) == (doc["plan_id"], True, False)
    assert read.seq_len == 32 and read.why_not == doc["layout"]["limit"]["sentence"]
    assert [r.stages for r in read.replicas] == [plan.stages]
    assert (read.replicas[0].micro_batch, read.replicas[0].micro_batches) == (2, 3)
    assert {c.fellow_id for c in read.cards} == {s.fellow_id for s in plan.stages}
    assert [card_key(s) for s in plan.stages] == ["00:cpu", "01:cpu"]
    assert list(shown) == [*doc, "replicas", "job"]
    two = job_plan(job, [plan, plan])
    assert list(two) == [*doc, "replicas", "job"] and two["plan_id"] != doc["plan_id"]
    assert two["summary"].startswith("2 replicas, synced every ")
    assert [r["replica"] for r in two["replicas"]] == [0, 1]


def test_a_jobs_model_source_and_its_document() -> None:
    from p2pswarm.agent.training.jobs import ModelSource, model_source

    job = JobConfig.from_dict({"model": "tiny-llama", "steps": 4, "seq_len": 32})
    source = model_source(job)
    assert model_message(job) == source.to_doc() and list(source.to_doc()) == ["name", "config"]
    cut = source.cut_at([2])
    assert cut == ModelSource(source.name, {**source.config, "p2pswarm_stage_cut": [2]})
    assert "p2pswarm_stage_cut" not in source.config
