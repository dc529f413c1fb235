"""Re-inplacing a functional graph before it becomes a tpud program.

AOTAutograd hands torch_tpu functional graphs: a mutation of an input becomes
a functional op whose result is copied back into the input at the end
(`r = _foreach_mul(xs, 0.9); ...; copy_(xs[i], r[i])`). Run as written, each
such op allocates fresh results in the daemon and each copy_ is one more
record: a compiled AdamW step over 18 parameters is 19 foreach ops and 72
copy_ records. This pass turns a functional pointwise or `_foreach_` op into
its in-place variant where that cannot change what any op reads:

- into an intermediate (a value the graph computed, in memory of its own)
  that nothing reads after the op;
- into a graph input that the graph writes back anyway, when the copy_ back
  takes exactly this op's result (possibly updated in place afterwards by
  ops this pass rewrote), nothing reads the input after the op, nothing
  writes the result after the copy_, and the graph does not return it. The copy_ then copies a tensor onto
  itself and is dropped.

Aliasing is read from the graph's fake tensors (`node.meta["val"]`): values
that share a fake storage are views of each other. A graph without that
metadata, or an op whose self has another shape, strides or dtype than its
result, or overlaps itself, or is passed twice, is left as it is.
TORCH_TPU_REINPLACE=0 turns the pass off (for A/B measurements).
"""
import operator
import os

import torch
from torch.multiprocessing.reductions import StorageWeakRef

__all__ = ["reinplace", "enabled"]


def enabled():
    return os.environ.get("TORCH_TPU_REINPLACE", "1") != "0"


def _leaves(v):
    if isinstance(v, torch.Tensor):
        return [v]
    if isinstance(v, (list, tuple)):
        return [x for e in v for x in _leaves(e)]
    return []


def _fake_storages(node):
    return {StorageWeakRef(t.untyped_storage()) for t in _leaves(node.meta.get("val"))}


def _inplace_variant(op):
    """aten's in-place twin of a functional pointwise or _foreach_ op whose
    arguments are the same, the first written; None if it has none."""
    if not isinstance(op, torch._ops.OpOverload) or op.namespace != "aten":
        return None
    schema = op._schema
    if schema.is_mutable:
        return None
    name = op._opname
    foreach = name.startswith("_foreach_")
    if not foreach and torch.Tag.pointwise not in op.tags:
        return None
    packet = getattr(torch.ops.aten, name + "_", None)
    inplace = getattr(packet, op._overloadname, None) if packet is not None else None
    if not isinstance(inplace, torch._ops.OpOverload):
        return None
    mine, theirs = schema.arguments, inplace._schema.arguments
    if len(mine) != len(theirs) or not mine:
        return None
    for i, (a, b) in enumerate(zip(mine, theirs)):
        if a.name != b.name or str(a.type) != str(b.type) or a.kwarg_only != b.kwarg_only:
            return None
        written = b.alias_info is not None and b.alias_info.is_write
        if written != (i == 0):
            return None
    if foreach:
        ok = (str(mine[0].type) == "List[Tensor]" and len(schema.returns) == 1
              and str(schema.returns[0].type) == "List[Tensor]" and not inplace._schema.returns)
    else:
        ok = (str(mine[0].type) == "Tensor" and len(schema.returns) == 1
              and str(schema.returns[0].type) == "Tensor")
    return inplace if ok else None


def _same_layout(a, b):
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
            and a.shape == b.shape and a.stride() == b.stride()
            and torch._debug_has_internal_overlap(a) != 1)


class _Pass:
    def __init__(self, gm):
        self.graph = gm.graph
        self.order = {n: i for i, n in enumerate(self.graph.nodes)}
        self.inputs = set()
        self.erased = set()
        # Memory that one rewrite made one: a result moved into its self's
        # storage, and so every view of that result made later in the graph
        # (whose fake tensor still names the result's own storage).
        self.merged = {}
        # The nodes whose values live in each storage (by its representative),
        # so that finding a storage's readers does not scan the whole graph.
        self.members = {}
        for n in self.graph.nodes:
            for st in _fake_storages(n):
                self.members.setdefault(st, []).append(n)
            if n.op == "placeholder":
                self.inputs |= self.storages(n)

    def find(self, st):
        while st in self.merged:
            st = self.merged[st]
        return st

    def storages(self, node):
        return {self.find(st) for st in _fake_storages(node)}

    def complete(self):
        # Every value-producing node must say what it is, or aliasing is unknown.
        for n in self.graph.nodes:
            if n.op == "call_function" and "val" not in n.meta:
                return False
        return True

    def users_after(self, storages, after, ignore=()):
        """Nodes after position `after` that use a value living in `storages`."""
        found = []
        for st in storages:
            for n in self.members.get(st, ()):
                if n not in self.erased:
                    found += [u for u in n.users if self.order[u] > after and u not in ignore]
        return found

    def results(self, node, foreach, count):
        """The node's result per self element: node itself, or its getitems."""
        if not foreach:
            return [node]
        out = [None] * count
        for u in node.users:
            if u.target is not operator.getitem or not isinstance(u.args[1], int):
                return None  # the list used whole: leave it
            if not 0 <= u.args[1] < count or out[u.args[1]] is not None:
                return None
            out[u.args[1]] = u
        return out

    def intermediate_ok(self, node, s):
        # A value this graph made, in memory no input shares, read by nothing later.
        st = self.storages(s)
        return (s.op == "call_function" and len(st) == 1 and not (st & self.inputs)
                and not self.users_after(st, self.order[node]))

    def write_back(self, s, r):
        """The copy_(s, r) that writes r back into input s, if it is one."""
        if s.op != "placeholder":
            return None
        for u in s.users:
            if (u.target is torch.ops.aten.copy_.default and len(u.args) == 2 and not u.kwargs
                    and u.args[0] is s and u.args[1] is r):
                return u
        return None

    def input_ok(self, node, s, r):
        c = self.write_back(s, r)
        if c is None:
            return None
        # Nothing reads the input (or a view of it) between the op and the copy_ ...
        if self.users_after(self.storages(s), self.order[node], ignore=(c,)):
            return None
        # ... and nothing writes the result after the copy_ (the input would change
        # too), nor is it returned (the caller would get the input itself).
        for u in self.users_after(self.storages(r), self.order[node]):
            if u.op == "output":
                return None
            if (self.order[u] > self.order[c] and isinstance(u.target, torch._ops.OpOverload)
                    and u.target._schema.is_mutable):
                return None
        return c

    def try_node(self, node, allow_inputs):
        inplace = _inplace_variant(node.target)
        if inplace is None or not node.args:
            return False
        foreach = inplace._opname.startswith("_foreach_")
        selves = node.args[0] if foreach else [node.args[0]]
        if not isinstance(selves, (list, tuple)) or not selves:
            return False
        if not all(isinstance(s, torch.fx.Node) for s in selves):
            return False
        # Each self its own memory, which no other argument reads (not even
        # through a view: an in-place kernel would read what it wrote).
        seen_storages = set()
        for s in selves:
            st = self.storages(s)
            if len(st) != 1 or st & seen_storages:
                return False
            seen_storages |= st
        for a in list(node.args[1:]) + list(node.kwargs.values()):
            for x in (a if isinstance(a, (list, tuple)) else [a]):
                if isinstance(x, torch.fx.Node) and self.storages(x) & seen_storages:
                    return False
        results = self.results(node, foreach, len(selves))
        if results is None:
            return False
        result_vals = node.meta["val"] if foreach else [node.meta["val"]]
        if not isinstance(result_vals, (list, tuple)) or len(result_vals) != len(selves):
            return False
        copies = []
        for s, r, rv in zip(selves, results, result_vals):
            if not _same_layout(s.meta.get("val"), rv):
                return False
            if self.intermediate_ok(node, s):
                continue
            if not allow_inputs or r is None:
                return False
            c = self.input_ok(node, s, r)
            if c is None:
                return False
            copies.append((c, s))
        node.target = inplace
        for s, rv in zip(selves, result_vals):
            (target,) = self.storages(s)
            st = self.find(StorageWeakRef(rv.untyped_storage()))
            if st != target:
                self.merged[st] = target
                self.members.setdefault(target, []).extend(self.members.pop(st, ()))
        for s, r in zip(selves, results):
            if r is None:
                continue
            if r is node:
                node.replace_all_uses_with(s)
            else:
                r.replace_all_uses_with(s)
                self.graph.erase_node(r)
                self.erased.add(r)
        for c, s in copies:  # now copy_(s, s)
            c.replace_all_uses_with(s)
            self.graph.erase_node(c)
            self.erased.add(c)
        return True


def reinplace(gm):
    """Rewrites gm's graph in place; returns how many ops became in-place."""
    if not enabled():
        return 0
    p = _Pass(gm)
    if not p.complete():
        return 0
    changed = 0
    # Intermediates first: a chain `t = f(x); g(t); copy_(x, t)` then ends in
    # the value f made, which the second round can move into x.
    for allow_inputs in (False, True):
        for node in list(p.graph.nodes):
            if node.op == "call_function" and node not in p.erased and p.try_node(node, allow_inputs):
                changed += 1
    if changed:
        p.graph.lint()
        gm.recompile()
    return changed
