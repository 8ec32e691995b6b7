"""`icml <m> plan`: what one step of each phase of a preset holds in memory and computes, per process, before
anything runs.

A method's `plan` module (`methods/<m>/plan.py`) lists its representative steps (`Step`): each builds the
preset's real-size models and tensors on torch's meta device (shapes and dtypes, no storage) and runs the
method's own step code on them — a training step with backward and optimizer update, the method's own large
tensors (KV caches, gradient blocks, soups' state dicts, rollout buffers). `measure` runs a step under
`Tracker`, a dispatch mode that follows every storage an op creates until it is freed, and under torch's
`FlopCounterMode`, and returns the peak bytes split by what they hold, the FLOPs and the largest tensor.

Why a tracker of our own and not torch's `MemTracker` (torch.distributed._tools): MemTracker keeps per-module
snapshots of every op and needs 66 s for one Llama-3.1-8B training step on the meta device (this machine,
torch 2.13); this one needs a few. tests/test_plan.py pins the two to each other on a small model.

The meta device is also our GPU-readiness check without a GPU: it refuses to mix with a non-scalar CPU tensor
exactly where CUDA does, so a step that makes a tensor on the CPU by mistake fails here as it would on a GPU.
A method with no GPU part declares `NO_GPU = "why"` in its plan module instead of steps; one whose GPU part
depends on the config (a paper path beside CPU tiers) defines `no_gpu(cfg)`, "" where the config has one.
"""
from __future__ import annotations

import contextlib
import gc
import re
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

from icml.cli.errors import UsageError

PARTS = ("parameters", "gradients", "optimizer", "activations", "method_buffers")
FIT_FRACTION = 0.9  # of a GPU's memory a step may use: the rest is the CUDA context and allocator fragmentation
_UNITS = {"b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30,
          "tib": 2 ** 40}


@dataclass(frozen=True)
class Step:
    """One representative step of a phase. `run(tracker)` builds what the step needs with
    `torch.device(tracker.device)` as the place of models, hands models and optimizers to `tracker.watch` and
    marks the method's own large tensors with `tracker.buffers()` / `tracker.buffer(t)`."""
    phase: str  # train | eval | the method's own verb
    what: str  # one line: what the step is, at which sizes
    run: Callable[["Tracker"], Any]
    # How many times `run` performs the step: a training step runs twice, so that the second holds the
    # optimizer's state from its start as every step after the first does. FLOPs are reported per step.
    repeats: int = 1


@dataclass(frozen=True)
class Hardware:
    gpus: int
    gpu_mem: float  # bytes per GPU

    def __str__(self) -> str:
        return f"{self.gpus} × {self.gpu_mem / 1e9:g} GB"


def parse_mem(text: str) -> float:
    """'80GB' / '141 GB' / '80GiB' → bytes (GB = 10⁹ bytes, GiB = 2³⁰)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]i?b|b)?\s*", text.lower())
    if not match:
        raise UsageError(f"--gpu-mem '{text}' is not a memory size", "e.g. --gpu-mem 80GB or --gpu-mem 24GiB")
    value = float(match.group(1)) * _UNITS[match.group(2) or "gb"]
    if value <= 0:
        raise UsageError(f"--gpu-mem '{text}' is not positive", "e.g. --gpu-mem 80GB")
    return value


class OverBudget(Exception):
    """A step's live bytes passed the tracker's limit."""


class Tracker:
    """Live bytes of every tensor storage created inside it, by what the storage holds, and their peak.

    Storages are counted once however many views share them, and released when torch frees them. What a
    storage holds is decided at the end of the step, for the storages live at the peak: parameters and buffers
    of watched modules, their gradients, watched optimizers' state, the method's buffers (created inside
    `buffers()` or marked with `buffer`), and activations (everything else: saved activations and
    temporaries)."""

    def __init__(self, device: str = "meta", limit: float | None = None):
        self.device = device
        self.limit = limit  # bytes: past them the step stops with OverBudget (a quick "does not fit")
        self._serials: dict[int, int] = {}  # id(storage) → serial while the storage lives
        self._live: dict[int, int] = {}  # serial → bytes
        self._next = 0
        self._labels: dict[int, str] = {}  # serial → "method_buffers" (set at creation or by buffer())
        self._label: str | None = None
        self._watched: list[Any] = []
        self._grads: set[int] = set()
        self.live_bytes = 0
        self.peak_bytes = 0
        self._peak_live: dict[int, int] = {}
        self.largest: dict[str, Any] = {"bytes": 0}
        self._mode = None

    # -- what the step tells the tracker
    def watch(self, *objects) -> None:
        """Modules (their parameters, buffers and gradients) and optimizers (their state)."""
        import torch

        for obj in objects:
            self._watched.append(obj)
            if isinstance(obj, torch.nn.Module):
                for tensor in list(obj.parameters()) + list(obj.buffers()):
                    self._add(tensor, "register")
                    if getattr(tensor, "grad", None) is not None:
                        self._grads.add(self._add(tensor.grad, "register"))
                for param in obj.parameters():
                    if param.requires_grad:
                        param.register_post_accumulate_grad_hook(self._grad_hook)
            elif isinstance(obj, torch.optim.Optimizer):  # state made by earlier steps is live from the start
                for state in obj.state.values():
                    for value in state.values():
                        if isinstance(value, torch.Tensor):
                            self._add(value, "register")

    def buffer(self, *tensors) -> None:
        for tensor in tensors:
            serial = self._add(tensor, "buffer")
            if serial is not None:
                self._labels[serial] = "method_buffers"

    @contextlib.contextmanager
    def buffers(self):
        """Storages created inside are the method's own buffers."""
        previous, self._label = self._label, "method_buffers"
        try:
            yield
        finally:
            self._label = previous

    # -- bookkeeping
    def _grad_hook(self, param) -> None:
        serial = self._serial(param.grad)
        if serial is not None:
            self._grads.add(serial)

    def _serial(self, tensor) -> int | None:
        try:
            return self._serials.get(id(tensor.untyped_storage()))
        except (RuntimeError, NotImplementedError):  # sparse or other storage-less tensors
            return None

    def _add(self, tensor, op: str) -> int | None:
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return None
        key = id(storage)
        if key in self._serials:
            return self._serials[key]
        if storage.device.type != torch_device_type(self.device):  # a GPU's memory is the question: CPU scalars
            return None  # (optimizer step counters, index tensors) are not on it
        serial, self._next = self._next, self._next + 1
        nbytes = storage.nbytes()
        self._serials[key] = serial
        self._live[serial] = nbytes
        if self._label:
            self._labels[serial] = self._label
        weakref.finalize(storage, self._free, key, serial)
        self.live_bytes += nbytes
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes
            self._peak_live = dict(self._live)
            if self.limit is not None and self.peak_bytes > self.limit:
                raise OverBudget(self.peak_bytes)
        if nbytes > self.largest["bytes"]:
            self.largest = {"bytes": nbytes, "shape": list(tensor.shape), "dtype": str(tensor.dtype).replace("torch.", ""),
                            "op": op}
        return serial

    def _free(self, key: int, serial: int) -> None:
        if self._serials.get(key) == serial:
            del self._serials[key]
        self.live_bytes -= self._live.pop(serial, 0)

    def _on_outputs(self, op: str, outputs) -> None:
        import torch
        from torch.utils._pytree import tree_leaves

        for leaf in tree_leaves(outputs):
            if isinstance(leaf, torch.Tensor):
                self._add(leaf, op)

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        tracker = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                tracker._on_outputs(str(func.overloadpacket.__name__), out)
                return out

        self._mode = _Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        self._mode = None
        return False

    # -- the result
    def parts_at_peak(self) -> dict[str, int]:
        import torch

        params, grads, optim = set(), set(self._grads), set()
        for obj in self._watched:
            if isinstance(obj, torch.nn.Module):
                for tensor in list(obj.parameters()) + list(obj.buffers()):
                    params.add(self._serial(tensor))
                    if getattr(tensor, "grad", None) is not None:
                        grads.add(self._serial(tensor.grad))
            elif isinstance(obj, torch.optim.Optimizer):
                for state in obj.state.values():
                    for value in state.values():
                        if isinstance(value, torch.Tensor):
                            optim.add(self._serial(value))
        parts = dict.fromkeys(PARTS, 0)
        for serial, nbytes in self._peak_live.items():
            if serial in params:
                part = "parameters"
            elif serial in grads:
                part = "gradients"
            elif serial in optim:
                part = "optimizer"
            else:
                part = self._labels.get(serial, "activations")
            parts[part] += nbytes
        return parts


@contextlib.contextmanager
def cuda_attention(active: bool = True):
    """Attention as a GPU runs it, for a step on the meta device. On CUDA, `scaled_dot_product_attention`
    without a mask runs a fused kernel (memory-efficient in float32, flash in half precision) that never holds
    the [heads, tokens, tokens] scores; on meta torch always takes the math path, which does. Inside, the
    memory-efficient kernel's own op stands in (it has a meta implementation and a backward). Calls with a
    mask, dropout or grouped heads keep torch's choice."""
    if not active:
        yield
        return
    import torch
    import torch.nn.functional as F

    fallback = F.scaled_dot_product_attention

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if attn_mask is not None or dropout_p or enable_gqa:
            return fallback(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
        return torch.ops.aten._scaled_dot_product_efficient_attention(
            query, key, value, None, query.requires_grad or key.requires_grad, 0.0, is_causal, scale=scale)[0]

    F.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = fallback


# The published configs of the paper models the language-model methods name (transformers' config keys): a plan
# builds them on meta, so sizing Llama-3.1-8B or Qwen3-8B needs no checkpoint
PAPER_LMS = {
    "llama-3.1-8b": ("llama", dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                                   num_key_value_heads=8, intermediate_size=14336, vocab_size=128256,
                                   max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
                                   tie_word_embeddings=False)),
    "qwen3-8b": ("qwen3", dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                               head_dim=128, intermediate_size=12288, vocab_size=151936, max_position_embeddings=40960,
                               rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)),
}


def lm_config(model: str | None, name: str):
    """The transformers config of the language model a plan sizes: the --model checkpoint's own (its headers,
    through cli/checkpoints.py, no weights read), else the published config of PAPER_LMS[name]."""
    from transformers import AutoConfig

    if model:
        from icml.cli import checkpoints

        ckpt = checkpoints.resolve(model, weights=False)
        return AutoConfig.from_pretrained(*ckpt.args(), **ckpt.kwargs())
    family, sizes = PAPER_LMS[name]
    return AutoConfig.for_model(family, **sizes)


def torch_device_type(device) -> str:
    return str(device).split(":")[0]


def measure(step: Step, device: str = "meta", limit: float | None = None) -> dict[str, Any]:
    """Run one step under the tracker and torch's FLOP counter: its peak bytes and their parts, FLOPs, the
    largest tensor it created. With `limit`, a step stops as soon as it holds more (`stopped_over`: the bytes
    it held then; its peak, parts and FLOPs are what it reached so far)."""
    from torch.utils.flop_counter import FlopCounterMode

    tracker = Tracker(device, limit)
    flops = FlopCounterMode(display=False)
    stopped = None
    # Python's cycle collector frees tensors held in reference cycles whenever it happens to run, which would
    # make a peak depend on what ran before: off during the step, so such tensors count as held (the worst case)
    gc.collect()
    collecting = gc.isenabled()
    gc.disable()
    try:
        with tracker, flops:
            step.run(tracker)
    except OverBudget as over:
        stopped = over.args[0]
    finally:
        if collecting:
            gc.enable()
    row = {"phase": step.phase, "what": step.what, "peak_bytes": tracker.peak_bytes, "parts": tracker.parts_at_peak(),
           "flops": int(flops.get_total_flops()) // step.repeats, "largest_tensor": tracker.largest}
    if stopped is not None:
        row["stopped_over"] = stopped
    return row


def plan(method, cfg, hardware: Hardware | None, preset: str, stop_over_budget: bool = False) -> dict[str, Any]:
    """The method's plan for `cfg` as one JSON-able object: per step and overall, against `hardware` (default:
    what the plan module names for the preset). `stop_over_budget`: a step stops as soon as it does not fit
    (a quick answer to "does it fit?"; its numbers are then lower bounds)."""
    module = plan_module(method)
    reason = no_gpu(module, cfg)
    if reason:
        return {"method": method.name, "preset": preset, "no_gpu": reason, "fits": True}
    hardware = hardware or module.hardware(preset)
    budget = FIT_FRACTION * hardware.gpu_mem
    steps = [measure(step, limit=budget if stop_over_budget else None) for step in module.steps(cfg, hardware.gpus)]
    for row in steps:
        row["fits"] = row["peak_bytes"] <= budget
    worst = max(steps, key=lambda row: row["peak_bytes"])
    state = sum(worst["parts"][p] for p in ("parameters", "gradients", "optimizer"))
    out = {"method": method.name, "preset": preset,
           "hardware": {"gpus": hardware.gpus, "gpu_mem_bytes": hardware.gpu_mem, "text": str(hardware),
                        "usable_fraction": FIT_FRACTION},
           "processes": hardware.gpus, "peak_bytes": worst["peak_bytes"], "fits": all(r["fits"] for r in steps),
           "steps": steps, "layout": module.LAYOUT}
    if not out["fits"]:
        sharded = worst["peak_bytes"] - state + state / hardware.gpus
        if hardware.gpus == 1:
            out["sharding"] = (f"the model state is {_gb(state)} of the worst step's {_gb(worst['peak_bytes'])}: "
                               "fewer tokens or rows per step, or more GPUs with the state sharded (--gpus N)")
        else:
            out["sharding"] = (f"every process holds the whole model state ({_gb(state)}: parameters, gradients, "
                               f"optimizer); sharded over {hardware.gpus} processes (FSDP / ZeRO-3) the worst step "
                               f"would need {_gb(sharded)}" + (" — fits" if sharded <= budget else
                                                               " — still too much: fewer tokens or rows per step"))
    return out


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.3g} GB"


def _flops(n: float) -> str:
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.3g} FLOP"


def render(result: dict[str, Any]) -> str:
    """The plan as the terminal shows it."""
    if "no_gpu" in result:
        return f"{result['method']} ({result['preset']}): no GPU part — {result['no_gpu']}"
    lines = [f"{result['method']} --preset {result['preset']} on {result['hardware']['text']} "
             f"({result['layout']}); a step fits when its peak ≤ {FIT_FRACTION:.0%} of a GPU:"]
    for row in result["steps"]:
        parts = ", ".join(f"{name.replace('_', ' ')} {_gb(v)}" for name, v in row["parts"].items() if v)
        big = row["largest_tensor"]
        if "stopped_over" in row:
            lines += [f"  {row['phase']}: {row['what']}",
                      f"    stopped when it held {_gb(row['stopped_over'])}: DOES NOT FIT"]
            continue
        lines += [f"  {row['phase']}: {row['what']}",
                  f"    peak {_gb(row['peak_bytes'])} per process ({parts}); {_flops(row['flops'])} per step; "
                  f"largest tensor {big.get('shape')} {big.get('dtype', '')} {_gb(big['bytes'])}; "
                  + ("fits" if row["fits"] else "DOES NOT FIT")]
    lines.append("fits" if result["fits"] else "does not fit")
    if "sharding" in result:
        lines.append(result["sharding"])
    return "\n".join(lines)


def no_gpu(module, cfg) -> str:
    """Why this config has no GPU part ("" when it has one): the module's NO_GPU, or its no_gpu(cfg) where only
    some presets use a GPU."""
    if getattr(module, "NO_GPU", ""):
        return module.NO_GPU
    return module.no_gpu(cfg) if hasattr(module, "no_gpu") else ""


def plan_module(method):
    """methods/<m>/plan.py, or one line saying the method has none yet."""
    import importlib.util

    if importlib.util.find_spec(f"{method.package}.plan") is None:
        raise UsageError(f"{method.name} has no plan yet: its steps are not sized",
                         "its README's 'Paper preset' section says what the paper preset needs")
    return method.part("plan")


def default_hardware(method, preset: str) -> Hardware:
    module = plan_module(method)
    return module.hardware(preset) if hasattr(module, "hardware") else Hardware(1, 80e9)
