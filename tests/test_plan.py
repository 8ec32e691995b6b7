"""`icml <m> plan` (cli/plan.py): the tracker against torch's own MemTracker, every planned step run on the meta
device (our GPU-readiness check: a tensor made on the CPU by mistake fails there as on CUDA), each paper plan
against the hardware its README names (and an oversized one reported as not fitting), and a smoke-sized plan
against what the same steps allocate for real on the CPU."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from icml.cli import lifecycle, registry
from icml.cli import plan as planning
from icml.cli.errors import UsageError

PLANNED = [name for name, package in registry.METHODS.items() if importlib.util.find_spec(f"{package}.plan")]
# What the paper-plan test sizes, where the whole preset costs minutes on the meta device: the settings that
# bound its memory (the test says which)
PAPER_TEST_SET = {"latent-thought": ["arms=vanilla_2x,ponderlm2_k2"]}
# Steps whose CPU kernels are not the ones a GPU (or the meta device) runs, left out of the smoke-vs-CPU test: ATen's
# GRU layer on the CPU projects every time step's input at once (RNN.cpp, CPU only; the meta device steps it as
# CUDA's non-cuDNN path does), 8 % more peak in belief-filter's gru update. Its meta step runs in the paper test.
SMOKE_CPU_SET = {"belief-filter": ["arms=obs_only,lof_belief,lof_logits,alf,deep_alf,diag_lrnn"]}


def _cfg(name: str, preset: str, overrides=()):
    method = registry.get(name)
    cfg, _, _ = lifecycle.resolve_config(method, preset, None, None, list(overrides), validate=False)
    return method, cfg


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=100, attn_implementation="eager")
    with torch.device("meta"):
        return LlamaForCausalLM(config)


def test_tracker_agrees_with_torch_memtracker():
    """The same AdamW step (second step: optimizer state live from the start) measured by torch's MemTracker
    and by ours: the same peak to the byte, and the same parameters and gradients at it. MemTracker books the
    update's temporaries under its optimizer state; we keep the state (what outlives the step: MemTracker's
    after the step) apart and count the temporaries with the activations."""
    from torch.distributed._tools.mem_tracker import MemTracker

    def step(model, optimizer, ids):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    ids = torch.randint(0, 100, (2, 16), device="meta")
    model = _tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), foreach=False)
    step(model, optimizer, ids)  # optimizer state exists before either tracker starts
    reference = MemTracker()
    reference.track_external(model, optimizer)
    with reference:
        step(model, optimizer, ids)
    meta = torch.device("meta")
    peak, after = reference.get_tracker_snapshot("peak")[meta], reference.get_tracker_snapshot("current")[meta]
    peak = {getattr(k, "value", k): v for k, v in peak.items()}
    after = {getattr(k, "value", k): v for k, v in after.items()}

    ours = planning.Tracker()
    with ours:
        ours.watch(model, optimizer)
        step(model, optimizer, ids)
    parts = ours.parts_at_peak()
    assert ours.peak_bytes == peak["Total"]
    assert parts["parameters"] == peak["Parameter"] + peak["Buffer"]
    assert parts["gradients"] == peak["Gradient"]
    assert parts["optimizer"] == after["Optstate"]
    assert parts["activations"] == peak["Activation"] + peak["Temp"] + peak["Optstate"] - after["Optstate"]


def test_tracker_counts_a_storage_once_and_frees_it():
    tracker = planning.Tracker()
    with tracker:
        x = torch.empty(1000, device="meta")  # 4 000 bytes
        view = x.view(10, 100)[2:]  # a view: no new storage
        with tracker.buffers():
            cache = torch.zeros(250, dtype=torch.float64, device="meta")  # 2 000 bytes, the method's own
        assert tracker.live_bytes == 6000
        del x, view
        assert tracker.live_bytes == 2000
        y = torch.ones(100, device="meta")  # 400 bytes after the free: the peak stays
    assert tracker.peak_bytes == 6000
    assert tracker.parts_at_peak() == {"parameters": 0, "gradients": 0, "optimizer": 0, "activations": 4000,
                                       "method_buffers": 2000}
    assert tracker.largest["bytes"] == 4000 and tracker.largest["shape"] == [1000]
    del cache, y


def test_meta_device_refuses_a_cpu_tensor_as_cuda_does():
    """The GPU-readiness check rests on this: a non-scalar CPU tensor mixed into a step fails; a 0-dim scalar
    and CPU index tensors pass, on meta as on CUDA."""
    x = torch.ones(3, 3, device="meta")
    with pytest.raises(RuntimeError):
        x + torch.ones(3, 3)
    assert (x + torch.tensor(2.0)).device.type == "meta"
    assert x[torch.tensor([0, 2])].shape == (2, 3)


def test_gpu_mem_parsing():
    assert planning.parse_mem("80GB") == 80e9
    assert planning.parse_mem("24 GiB") == 24 * 2 ** 30
    assert planning.parse_mem("141") == 141e9
    for bad in ("eighty", "-3GB", "0GB", "80 GBs"):
        with pytest.raises(UsageError):
            planning.parse_mem(bad)


def test_every_method_has_a_plan():
    assert PLANNED == list(registry.METHODS), set(registry.METHODS) - set(PLANNED)


@pytest.mark.parametrize("name", PLANNED)
def test_paper_plan_against_its_hardware(name):
    """The paper preset's plan on the hardware the README names fits, or the plan module says why not (and the
    README quotes it); `OVERSIZE` (the module's --set that outgrows any GPU) never fits (planned until it stops
    fitting: the early stop answers the question without running the rest of the steps)."""
    method, cfg = _cfg(name, "paper", PAPER_TEST_SET.get(name, []))
    module = method.part("plan")
    result = planning.plan(method, cfg, None, "paper")
    json.dumps(result)
    readme = Path(module.__file__).with_name("README.md").read_text()
    assert f"icml {name} plan" in readme, "the README's paper-preset section quotes its plan"
    if planning.no_gpu(module, cfg):
        assert result["fits"] and "\n" not in result["no_gpu"]
        return
    assert result["fits"] is not bool(getattr(module, "DOES_NOT_FIT", "")), planning.render(result)
    for step in result["steps"]:
        assert step["flops"] > 0 and step["peak_bytes"] == sum(step["parts"].values())
    _, big = _cfg(name, "paper", PAPER_TEST_SET.get(name, []) + list(module.OVERSIZE))
    assert not planning.plan(method, big, planning.Hardware(1, 80e9), "paper", stop_over_budget=True)["fits"]


@pytest.mark.parametrize("name", PLANNED)
def test_smoke_plan_agrees_with_the_cpu(name):
    """Every step of the smoke preset, on the meta device (the plan) and for real on the CPU: the same method
    buffers, parameters and gradients to the byte, and the same peak up to what is not the method's: the
    optimizer's 0-dim step counters (4 bytes per parameter tensor: on a GPU they stay on the host, so the plan
    leaves them out while the CPU run holds them) and fused attention's side outputs (the CPU's flash kernel
    against CUDA's memory-efficient one, which `cuda_attention` plans) — at most 0.5 % of the peak. FLOPs agree
    within 10 %: torch's FLOP formulas for the two attention kernels differ (5.1 % of attribute-motion's smoke
    fine-tuning step, a UNet whose cost is mostly attention; 0 for a plan without fused attention). The plan's
    shapes are the run's."""
    method, cfg = _cfg(name, "smoke", SMOKE_CPU_SET.get(name, []))
    module = method.part("plan")
    if planning.no_gpu(module, cfg):
        pytest.skip(f"{name}'s smoke preset has no GPU part: {planning.no_gpu(module, cfg)}")
    for step in module.steps(cfg, 1):
        meta, cpu = planning.measure(step, "meta"), planning.measure(step, "cpu")
        assert abs(cpu["peak_bytes"] - meta["peak_bytes"]) <= max(1024, 0.005 * meta["peak_bytes"]), step.what
        for part in ("parameters", "gradients", "method_buffers"):
            assert meta["parts"][part] == cpu["parts"][part], (step.what, part)
        assert abs(cpu["flops"] - meta["flops"]) <= 0.1 * meta["flops"], step.what


def test_plan_command_prints_one_json_object(icml):
    result = icml("latent-thought", "plan", "--preset", "smoke", "--gpus", "2", "--gpu-mem", "16GB", "--json")
    assert result.code == 0, result.err
    data = result.json()
    assert data["hardware"]["gpus"] == 2 and data["hardware"]["gpu_mem_bytes"] == 16e9
    assert data["fits"] and {s["phase"] for s in data["steps"]} == {"train", "eval"}
    assert set(data["steps"][0]["parts"]) == set(planning.PARTS)
    text = icml("latent-thought", "plan", "--preset", "smoke")
    assert text.code == 0 and "fits" in text.out
    bad = icml("latent-thought", "plan", "--gpu-mem", "lots")
    assert bad.code == 2 and "--gpu-mem 'lots'" in bad.err
