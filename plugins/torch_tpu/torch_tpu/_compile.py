"""torch.compile on "tpu": a graph is captured once and run by tpud as one program.

`torch.compile(model, backend="tpu")` (Dynamo finds this backend through the
`torch_dynamo_backends` entry point) and the default `torch.compile(model)` on
tpu tensors (Inductor would send a "tpu" graph to its Pallas code generator,
which needs JAX; torch_tpu routes such graphs here instead) both end in
`tpu_backend`:

- AOTAutograd splits the graph into functional forward and backward graphs
  (mutations functionalized, written back by its wrapper or by copy_ ops in
  the graph); ops whose results only replace their inputs are then turned
  back into in-place ops (_reinplace.py).
- Each graph, for each input signature (dtypes, shapes, strides, which inputs
  share storage, scalar values), is *captured* once, as CUDA graphs are: its
  ATen ops go through torch_tpu as in eager mode, but their records are kept
  in a program instead of run (libtpuclient's Session::BeginCapture). The
  program is written once into the session's shared memory.
- Every call is then one record (kRunProgram): tpud runs the program's ops
  back to back, its inputs and outputs moved to this call's tensors (outputs
  get fresh memory each call), its random ops reseeded from the tpu
  generator, so compiled dropout repeats under torch.tpu.manual_seed.
- The program's intermediates keep the memory they had when captured (the
  allocator holds it for the program), counted against the session like any
  tensor; like a CUDA graph, a program runs on the stream it was captured on.
- A graph that cannot be captured (an op whose values go to the host, a copy
  from the host, several chips) runs eagerly on tpu, op by op, and says why
  once (`torch_tpu._compile.explain()`).
"""
import itertools
import logging
import weakref

import torch

from . import _C, _reinplace

log = logging.getLogger("torch_tpu.compile")

__all__ = ["tpu_backend", "explain"]

_graph_ids = itertools.count(1)
# Signatures captured per graph before new ones run eagerly: a host value
# that changes every call (a CPU step count) would otherwise capture anew
# each time.
MAX_CAPTURES_PER_GRAPH = 8
# Why graphs ran eagerly, by graph name (for explain() and tests).
_eager_reasons = {}
# Programs captured and runs made, for tests and tpuctl-less inspection.
stats = {"captures": 0, "runs": 0, "eager_calls": 0, "reinplaced": 0}


def explain():
    """Graphs that run eagerly on tpu instead of as programs, and why."""
    return dict(_eager_reasons)


def _signature(args):
    # In C++ (it runs on every call): bytes, None (a host tensor: eager), or
    # False for an argument it does not know (a SymInt): then in Python.
    key = _C._program_signature(args)
    return _signature_py(args) if key is False else key


def _signature_py(args):
    key = []
    storages = {}  # which inputs share storage matters to the program
    for a in args:
        if isinstance(a, torch.Tensor):
            if a.device.type != "tpu":
                if a.dim() == 0 and a.numel() == 1:
                    key.append(("cpu", a.dtype, a.item()))
                    continue
                return None  # a host tensor in the graph: eager
            st = a.untyped_storage()
            idx = storages.setdefault(st.data_ptr(), len(storages))
            key.append(("t", a.device.index, a.dtype, tuple(a.shape), tuple(a.stride()),
                        a.storage_offset(), st.nbytes(), idx))
        elif isinstance(a, (int, float, bool)) or a is None:
            key.append(("v", type(a).__name__, a))
        elif isinstance(a, torch.SymInt):
            key.append(("v", "int", int(a)))
        else:
            return None
    return tuple(key)


class _Program:
    """One capture of a graph for one input signature."""

    def __init__(self, handle, inputs, outputs, new_specs):
        self.handle = handle
        # Per distinct input storage: (arg index, captured address, bytes).
        self.inputs = inputs
        # Per output: ("input", arg index, meta) | ("new", slot, meta) | ("value", v)
        self.outputs = outputs
        # Per storage the outputs need anew each run: (captured address, bytes, device)
        self.new_specs = new_specs
        # The same, as _C._program_call takes them.
        self.call_fresh = [(ptr, nbytes, device.index) for ptr, nbytes, device in new_specs]
        self.call_outputs = [(0, o[1]) if o[0] == "value" else
                             (1 if o[0] == "input" else 2, o[1], *o[2]) for o in outputs]
        weakref.finalize(self, _C._program_release, handle)


class _CompiledGraph:
    """What runs one forward or backward graph (AOTAutograd calls it boxed)."""

    def __init__(self, gm, kind, max_captures=None):
        self.gm = gm
        self.name = f"graph {next(_graph_ids)} ({kind})"
        self.programs = {}
        self.max_captures = MAX_CAPTURES_PER_GRAPH if max_captures is None else max_captures

    def __call__(self, args):
        key = _signature(args)
        prog = self.programs.get(key) if key is not None else None
        if prog is None and key is not None and key not in self.programs:
            if len(self.programs) >= self.max_captures:
                self._give_up(key, f"{len(self.programs)} input signatures captured already (a host "
                                   "value that changes every call? a capturable optimizer keeps "
                                   "its step on the device)")
                stats["eager_calls"] += 1
                return self._eager(args)
            prog, out = self._capture(key, args)
            if prog is not None:
                return out
        if prog is None:
            stats["eager_calls"] += 1
            return self._eager(args)
        return self._run(prog, args)

    def _eager(self, args):
        out = self.gm(*args)
        return list(out) if isinstance(out, (tuple, list)) else [out]

    def _capture(self, key, args):
        tensors = [(i, a) for i, a in enumerate(args)
                   if isinstance(a, torch.Tensor) and a.device.type == "tpu"]
        devices = {a.device for _, a in tensors}
        if len(devices) > 1:
            return self._give_up(key, f"inputs on {len(devices)} devices"), None
        with torch.tpu.device(next(iter(devices)) if devices else None):
            # Random ops draw seeds while captured; a run reseeds them all
            # from one draw, so the generator is put back as it was.
            rng = torch.tpu.get_rng_state()
            prog, out = self._capture_here(key, args, tensors)
            torch.tpu.set_rng_state(rng)
            if prog is not None:
                # The capture ran nothing: this first call runs the program
                # on the very tensors it was captured with.
                _C._program_run(prog.handle, [], _C._next_run_seed())
                stats["runs"] += 1
            return prog, out

    def _capture_here(self, key, args, tensors):
        _C._capture_begin()
        try:
            out = self.gm(*args)
        except Exception as e:  # noqa: BLE001 - any op that cannot be captured
            _C._capture_abort()
            return self._give_up(key, str(e).splitlines()[0][:300]), None
        out = list(out) if isinstance(out, (tuple, list)) else [out]
        # Inputs: each distinct storage, bound to the call's at every run.
        inputs, seen = [], {}
        for i, a in tensors:
            st = a.untyped_storage()
            if st.data_ptr() not in seen:
                seen[st.data_ptr()] = i
                inputs.append((i, st.data_ptr(), st.nbytes()))
        outputs, new_specs, new_slots = [], [], {}
        for o in out:
            if not isinstance(o, torch.Tensor):
                outputs.append(("value", o))
                continue
            if o.device.type != "tpu":
                _C._capture_abort()
                return self._give_up(key, "an output on the host"), None
            st = o.untyped_storage()
            meta = (o.dtype, tuple(o.shape), tuple(o.stride()), o.storage_offset())
            ptr = st.data_ptr()
            if ptr in seen:
                outputs.append(("input", seen[ptr], meta))
                continue
            if ptr not in new_slots:
                new_slots[ptr] = len(new_specs)
                new_specs.append((ptr, st.nbytes(), o.device))
            outputs.append(("new", new_slots[ptr], meta))
        try:
            handle = _C._capture_end(self.name, [p for p, _, _ in new_specs if p != 0])
        except RuntimeError as e:
            return self._give_up(key, str(e).splitlines()[0][:300]), None
        prog = _Program(handle, inputs, outputs, new_specs)
        self.programs[key] = prog
        stats["captures"] += 1
        return prog, out

    def _give_up(self, key, why):
        self.programs[key] = None
        if self.name not in _eager_reasons:
            log.warning("tpu: %s runs eagerly, op by op: %s", self.name, why)
        _eager_reasons[self.name] = why
        return None

    def _run(self, prog, args):
        out = _C._program_call(prog.handle, args, prog.inputs, prog.call_fresh,
                               prog.call_outputs, _C._next_run_seed())
        stats["runs"] += 1
        return out


def _graph_compiler(kind):
    def compile_graph(gm, example_inputs):
        # Functional ops whose results only replace their inputs run in place
        # (no fresh memory, no copy_ back): torch_tpu/_reinplace.py.
        stats["reinplaced"] += _reinplace.reinplace(gm)
        graph = _CompiledGraph(gm, kind)

        def run(args):
            return graph(args)

        run._boxed_call = True  # AOTAutograd passes one list and lets us free it
        run.graph = graph
        return run

    return compile_graph


def tpu_backend(gm, example_inputs, **kwargs):
    """Dynamo backend "tpu": AOTAutograd, then each graph as a tpud program."""
    from torch._dynamo.backends.common import aot_autograd

    return aot_autograd(fw_compiler=_graph_compiler("forward"),
                        bw_compiler=_graph_compiler("backward"),
                        inference_compiler=_graph_compiler("inference"),
                        keep_inference_input_mutations=True)(gm, example_inputs, **kwargs)


def _on_tpu(example_inputs):
    return any(isinstance(t, torch.Tensor) and t.device.type == "tpu" for t in example_inputs)


def install_default_compile():
    """Makes the default torch.compile (Inductor) hand graphs on tpu tensors to
    tpu_backend: Inductor maps a "tpu" device to its Pallas code generator."""
    wrapper = torch._TorchCompileInductorWrapper
    if getattr(wrapper, "_torch_tpu", False):
        return
    original = wrapper.__call__

    def __call__(self, model_, inputs_, **kwargs):
        if _on_tpu(inputs_):
            return tpu_backend(model_, inputs_)
        return original(self, model_, inputs_, **kwargs)

    wrapper.__call__ = __call__
    wrapper._torch_tpu = True
