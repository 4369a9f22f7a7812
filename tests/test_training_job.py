"""job.json: every field read and checked, clear errors, canonical form, the plan request,
the learning-rate schedule, and the data order (deterministic and resumable)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from p2pswarm.errors import ConfigError
from p2pswarm.models.tokenizer import ByteTokenizer
from p2pswarm.planner.request import request_from_dict
from p2pswarm.training.data import SampleStream, TokenData, corpus_text, load_tokens
from p2pswarm.training.job import CORPUS, JobConfig, LrSchedule

FULL_JOB = {
    "model": "tiny-llama",
    "data": {"files": ["texts/a.txt"], "holdout_fraction": 0.1},
    "seq_len": 256, "micro_batch": 4, "micro_batches": 8, "steps": 2000,
    "lr": {"peak": 6e-4, "min": 6e-5, "warmup_steps": 100, "schedule": "cosine"},
    "optimizer": {"name": "adamw", "betas": [0.9, 0.95], "weight_decay": 0.1,
                  "grad_clip": 1.0},
    "mode": "full", "replicas": "auto",
    "sync": {"inner_steps": 100, "outer_lr": 0.7, "outer_momentum": 0.9, "codec": "topk",
             "codec_options": {"fraction": 0.01}, "update_codec": "int8",
             "staleness_bound": 2, "round_deadline_s": 120, "speed_aware": True},
    "checkpoint": {"dir": "ckpt", "interval_steps": 200, "keep": 2, "copies": 2},
    "seed": 7,
}


def test_full_job_reads_with_paths_relative_to_the_file(tmp_path: Path) -> None:
    path = tmp_path / "job.json"
    path.write_text(json.dumps(FULL_JOB))
    job = JobConfig.from_json(path)
    assert job.model.name == "tiny-llama" and not job.model.from_scratch
    assert job.data.files == (str(tmp_path / "texts/a.txt"),)
    assert job.checkpoint.dir == str(tmp_path / "ckpt")
    assert (job.seq_len, job.micro_batch, job.micro_batches, job.steps) == (256, 4, 8, 2000)
    assert job.tokens_per_step == 256 * 4 * 8
    assert job.lr.total_steps == 2000 and job.lr.warmup_steps == 100
    assert job.sync.codec_kwargs() == {"fraction": 0.01}
    assert job.sync.update_codec_name() == "int8" and job.sync.update_codec_kwargs() == {}
    assert job.replicas is None and job.seed == 7
    # canonical: reading the canonical form back gives the same job
    assert JobConfig.from_dict(job.to_dict()) == job
    assert json.loads(json.dumps(job.to_dict())) == job.to_dict()


def test_defaults_and_scratch_model() -> None:
    config = {"vocab_size": 259, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4}
    job = JobConfig.from_json(json.dumps({"model": {"config": config}}))
    assert job.model.from_scratch and job.data.files == (CORPUS,)
    assert job.mode == "full" and job.lora is None and job.sync.codec == "int8"
    lora = JobConfig.from_dict({"model": "tiny-llama", "mode": "lora",
                                "lora": {"rank": 4, "targets": ["v_proj", "q_proj"],
                                         "base_dtype": "int4"}})
    assert lora.lora is not None and lora.lora.targets == ("q_proj", "v_proj")
    assert lora.lora.alpha == 8.0 and lora.lora.scale == 2.0


def test_plan_request_is_what_the_planner_reads() -> None:
    job = JobConfig.from_dict(FULL_JOB)
    request = request_from_dict(job.plan_request())
    assert (request.kind, request.seq_len, request.micro_batch, request.micro_batches) == (
        "train", 256, 4, 8)
    assert request.method == "full" and request.weights_dtype == "f32"
    lora = JobConfig.from_dict({**FULL_JOB, "mode": "lora",
                                "lora": {"rank": 8, "base_dtype": "int8"}})
    request = request_from_dict(lora.plan_request())
    assert request.method == "lora" and request.lora_rank == 8
    assert request.weights_dtype == "int8" and request.lora_targets == ("q_proj", "v_proj")


BAD: list[tuple[dict[str, Any], str]] = [
    ({}, '"model" is required'),
    ({"model": 3}, "model must be a built-in name"),
    ({"model": {"config": {"hidden_size": 8}}}, "model config lacks"),
    ({"model": "tiny-llama", "stpes": 3}, "unknown setting 'stpes'"),
    ({"model": "tiny-llama", "steps": 0}, "steps must be a whole number from 1 to"),
    ({"model": "tiny-llama", "seq_len": 1.5}, "seq_len must be a whole number"),
    ({"model": "tiny-llama", "mode": "qlora"}, 'mode .* must be "full" or "lora"'),
    ({"model": "tiny-llama", "lora": {"rank": 4}}, 'add "mode": "lora"'),
    ({"model": "tiny-llama", "mode": "lora", "lora": {"targets": ["qkv"]}},
     "lora.targets qkv unknown"),
    ({"model": "tiny-llama", "weights_dtype": "int8"}, "quantized bases are for mode lora"),
    ({"model": "tiny-llama", "lr": {"peak": 0}}, "lr.peak must be above 0"),
    ({"model": "tiny-llama", "lr": {"peak": 1e-3, "min": 1e-2}}, "lr.min .* is above"),
    ({"model": "tiny-llama", "steps": 10, "lr": {"warmup_steps": 10}},
     "warmup_steps 10 must be fewer than the 10 steps"),
    ({"model": "tiny-llama", "optimizer": "lion"}, "optimizer 'lion' must be one of"),
    ({"model": "tiny-llama", "optimizer": {"betas": [0.9]}}, "optimizer.betas"),
    ({"model": "tiny-llama", "replicas": 0}, "replicas must be a whole number"),
    ({"model": "tiny-llama", "sync": {"codec": "gzip"}}, "sync.codec 'gzip' must be one of"),
    ({"model": "tiny-llama", "sync": {"codec": "topk", "codec_options": {"fraction": 2}}},
     "fraction must be in"),
    ({"model": "tiny-llama", "sync": {"outer_momentum": 1.0}}, "outer_momentum must be below"),
    ({"model": "tiny-llama", "sync": {"speed_aware": "yes"}}, "speed_aware must be true"),
    ({"model": "tiny-llama", "checkpoint": {"dir": ""}}, "checkpoint.dir must be"),
    ({"model": "tiny-llama", "data": {"files": []}}, "at least one text file"),
    ({"model": "tiny-llama", "data": {"token_dtype": "int8"}}, "token_dtype"),
    ({"model": "tiny-llama", "seed": -1}, "seed must be a whole number from 0"),
]


@pytest.mark.parametrize(("data", "message"), BAD)
def test_bad_jobs_say_what_to_fix(data: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        JobConfig.from_dict(data)


def test_unreadable_job_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read job file"):
        JobConfig.from_json(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{nope")
    with pytest.raises(ConfigError, match="not valid JSON"):
        JobConfig.from_json(tmp_path / "bad.json")


def test_lr_schedule_warmup_then_cosine() -> None:
    lr = LrSchedule(peak_lr=1.0, min_lr=0.1, warmup_steps=10, total_steps=110)
    assert lr.lr_at(0) == pytest.approx(0.1) and lr.lr_at(9) == pytest.approx(1.0)
    assert lr.lr_at(10) == pytest.approx(1.0)
    assert lr.lr_at(60) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 2)))
    assert lr.lr_at(110) == pytest.approx(0.1) and lr.lr_at(500) == pytest.approx(0.1)
    values = [lr.lr_at(s) for s in range(10, 111)]
    assert values == sorted(values, reverse=True)
    assert LrSchedule(peak_lr=0.5, kind="constant", total_steps=9).lr_at(8) == 0.5


def test_data_order_is_deterministic_and_resumable(tmp_path: Path) -> None:
    job = JobConfig.from_dict({"model": "tiny-llama", "seq_len": 32})
    tokens = load_tokens(job.data, ByteTokenizer())
    assert tokens[0] == ByteTokenizer.bos_id and tokens.numel() > 30_000
    assert "We the People" in corpus_text()
    data = TokenData.split(tokens, 0.05, 32)
    assert data.train.numel() + data.holdout.numel() == tokens.numel()
    a = SampleStream(data.train, 32, seed=1)
    first = [a.next_batch(5) for _ in range(300)]  # several epochs
    b = SampleStream(data.train, 32, seed=1, position=700)
    assert torch.equal(b.next_batch(5), first[140])
    assert not torch.equal(SampleStream(data.train, 32, seed=2).next_batch(5), first[0])
    assert not torch.equal(SampleStream(data.train, 32, seed=1, stream=1).next_batch(5),
                           first[0])
    # an epoch visits every window once
    for epoch in (0, 3):
        starts = sorted(a.window_start(epoch * a.windows + i) for i in range(a.windows))
        assert starts == list(range(0, a.windows * 32, 32))
    # pre-tokenized arrays read as well
    (tmp_path / "t.bin").write_bytes(torch.arange(300, dtype=torch.int32).numpy().tobytes())
    job = JobConfig.from_dict({"model": "tiny-llama",
                               "data": {"token_files": [str(tmp_path / "t.bin")],
                                        "token_dtype": "int32"}})
    with pytest.raises(ConfigError, match="outside the model's vocabulary"):
        load_tokens(job.data, ByteTokenizer())
    (tmp_path / "u.bin").write_bytes(torch.arange(200, dtype=torch.int16).numpy().tobytes())
    job = JobConfig.from_dict({"model": "tiny-llama",
                               "data": {"token_files": [str(tmp_path / "u.bin")]}})
    assert load_tokens(job.data, ByteTokenizer()).tolist() == list(range(200))
