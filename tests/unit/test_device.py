"""`device: auto`, GPU placement of the stages, and the CPU no-op fence (no GPU needed)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from backends.runtime.device import record_fence, resolve_device
from backends.stages import triton_glue as g
from backends.stages.params import StageParams

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


@pytest.fixture
def gpus(monkeypatch):
    """Pretend torch sees ``n`` GPUs."""

    def set_count(n: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)

    return set_count


@pytest.mark.parametrize(
    "asked,kind,dev_id,count,want",
    [
        ("auto", "", -1, 0, "cpu"),  # no GPU anywhere
        ("auto", "CPU", -1, 0, "cpu"),
        ("auto", "", -1, 2, "cuda:0"),  # torch sees one: use it
        ("auto", "CPU", -1, 2, "cuda:0"),
        ("auto", "GPU", 3, 4, "cuda:3"),  # Triton gave the instance GPU 3
        ("cuda", "GPU", 2, 4, "cuda:2"),
        ("cuda", "", -1, 1, "cuda:0"),
        ("cuda:1", "GPU", 0, 2, "cuda:1"),  # an explicit index wins
        ("cpu", "GPU", 1, 2, "cpu"),
    ],
)
def test_resolve_device(gpus, asked, kind, dev_id, count, want):
    gpus(count)
    assert resolve_device(asked, kind, dev_id) == want


@pytest.mark.parametrize(
    "asked,kind,dev_id,count,words",
    [
        ("cuda", "", -1, 0, "sees no CUDA"),
        ("cuda:2", "", -1, 2, "only 2 GPUs"),
        ("tpu", "", -1, 0, "auto, cpu, cuda"),
        ("auto", "GPU", -1, 1, "no device id"),
    ],
)
def test_resolve_device_errors(gpus, asked, kind, dev_id, count, words):
    gpus(count)
    with pytest.raises(ValueError, match=words):
        resolve_device(asked, kind, dev_id)


def test_cpu_has_no_fence_and_auto_is_the_default():
    assert record_fence("cpu") is None
    assert StageParams().device == "auto"
    with pytest.raises(ValueError, match="device must be auto"):
        StageParams(device="gpu0")


class FakePb:
    class Logger:
        lines: list[str] = []

        @classmethod
        def log_info(cls, msg):
            cls.lines.append(msg)


def test_triton_instance_gpu_becomes_the_stage_device(gpus):
    gpus(2)
    args = {
        "model_config": json.dumps({"parameters": {}}),
        "model_instance_kind": "GPU",
        "model_instance_device_id": "1",
        "model_instance_name": "decode_0_1",
    }
    assert g.stage_params(FakePb, args, "decode").device == "cuda:1"
    assert "decode_0_1: running on cuda:1" in FakePb.Logger.lines[-1]
    args["model_instance_kind"] = "CPU"
    assert g.stage_params(FakePb, args, "prefill").device == "cuda:0"
    gpus(0)
    assert g.stage_params(FakePb, args, "prefill").device == "cpu"


def test_placement_flags_write_kind_gpu_instance_groups(tmp_path):
    out = tmp_path / "repo"
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "make_repo.py"), "--out", str(out)]
    place = ["--prefill-gpus", "0,1", "--decode-gpus", "2,3", "--instances", "decode=2"]
    subprocess.run(cmd + place, check=True, capture_output=True)
    group = r"instance_group \[ \{ count: (\d+), kind: (KIND_\w+)(?:, gpus: \[ ([\d, ]+) \])? \} \]"

    def read(stage):
        m = re.search(group, (out / stage / "config.pbtxt").read_text())
        return int(m.group(1)), m.group(2), m.group(3)

    assert read("prefill") == (1, "KIND_GPU", "0, 1")  # one instance on each GPU
    assert read("decode") == (2, "KIND_GPU", "2, 3")
    assert read("preprocess") == (1, "KIND_CPU", None)
    bad = subprocess.run(cmd + ["--decode-gpus", "1,x"], capture_output=True, text=True)
    assert bad.returncode != 0 and "--decode-gpus" in bad.stderr
    # tensor parallel: each N consecutive GPUs are one instance's ranks (Triton gives it the first)
    tp = ["--set", "prefill.tensor_parallel_size=2", "--prefill-gpus", "0,1,2,3"]
    subprocess.run(cmd + tp, check=True, capture_output=True)
    assert read("prefill") == (1, "KIND_GPU", "0, 2")
    bad = subprocess.run(cmd + tp[:2] + ["--prefill-gpus", "0,2"], capture_output=True, text=True)
    assert bad.returncode != 0 and "groups of 2 consecutive GPUs" in bad.stderr
