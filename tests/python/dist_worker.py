"""One rank of a torch.distributed job on the "tpu" backend, for the tests
in test_distributed.py (and bench/collectives_bench.py).

    python dist_worker.py SCENARIO RANK WORLD PORT [ARGS...]

Every rank builds its inputs from (rank, seed), so each can compute the CPU
reference of a collective for all ranks by itself. A scenario prints one
JSON line {"ok": ..., ...} at the end; a failed check raises.
"""
import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist

DTYPES = {
    "float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
    "bfloat16": torch.bfloat16, "int8": torch.int8, "uint8": torch.uint8,
    "int32": torch.int32, "int64": torch.int64, "bool": torch.bool,
    "complex64": torch.complex64, "float8_e4m3fn": torch.float8_e4m3fn,
}
# Moved but never reduced (as with NCCL).
MOVE_ONLY = (torch.float8_e4m3fn,)
OPS = {
    "sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "product": dist.ReduceOp.PRODUCT,
    "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX,
    "band": dist.ReduceOp.BAND, "bor": dist.ReduceOp.BOR, "bxor": dist.ReduceOp.BXOR,
}
BITWISE = {"band": torch.bitwise_and, "bor": torch.bitwise_or, "bxor": torch.bitwise_xor}
# PREMUL_SUM (torch.distributed._make_nccl_premul_sum) by a Python float, or
# by a 0-dim tpu tensor that differs per rank.
PREMUL = ("premul_float", "premul_tensor")


def takes(oname, dtype):
    """Whether NCCL (gloo for the bitwise ops) reduces dtype by oname."""
    if dtype in MOVE_ONLY:
        return False
    if oname in BITWISE:
        return not (dtype.is_floating_point or dtype.is_complex)
    if oname in PREMUL or oname == "avg":
        return dtype.is_floating_point or dtype.is_complex
    if oname in ("min", "max", "product"):
        return not dtype.is_complex  # torch refuses
    return True


def premul_factor(oname, rank):
    return 0.3 if oname == "premul_float" else 0.5 + 0.25 * rank


def reduce_op(oname, rank, dtype, dev):
    """Rank's ReduceOp for oname (a PREMUL_SUM carries the rank's factor)."""
    if oname == "premul_float":
        return dist._make_nccl_premul_sum(premul_factor(oname, rank))
    if oname == "premul_tensor":
        # Complex tensors reach the backend as view_as_real: a real factor.
        return dist._make_nccl_premul_sum(torch.tensor(
            premul_factor(oname, rank), dtype=dtype.to_real(), device=dev))
    return OPS[oname]


def data(rank, shape, dtype, seed=0):
    """Rank's input: small values, so products and sums stay exact where the
    dtype allows."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_complex:
        return torch.complex(torch.randn(shape, generator=g), torch.randn(shape, generator=g)).to(dtype)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) + 2).to(dtype)
    lo = 0 if dtype == torch.uint8 else -3
    return torch.randint(lo, 4, shape, generator=g).to(dtype)


def reduce_ref(tensors, op):
    wide = torch.float64 if not tensors[0].is_complex() else torch.complex128
    if op in PREMUL:
        # Every rank's input times its own factor, then summed.
        acc = sum(t.to(wide) * premul_factor(op, r) for r, t in enumerate(tensors))
        return acc.to(tensors[0].dtype)
    if op in BITWISE:
        acc = tensors[0].clone()
        for t in tensors[1:]:
            acc = BITWISE[op](acc, t)
        return acc
    acc = tensors[0].to(wide)
    if tensors[0].dtype == torch.bool:
        stack = torch.stack(tensors)
        return (stack.any(0) if op in ("sum", "max") else stack.all(0))
    if not tensors[0].is_floating_point() and not tensors[0].is_complex():
        # Integer arithmetic wraps the same way in any order.
        acc = tensors[0].clone()
        for t in tensors[1:]:
            acc = {"sum": torch.add, "product": torch.mul, "min": torch.minimum,
                   "max": torch.maximum}[op](acc, t)
        return acc
    for t in tensors[1:]:
        t = t.to(acc.dtype)
        acc = {"sum": torch.add, "avg": torch.add, "product": torch.mul,
               "min": torch.minimum, "max": torch.maximum}[op](acc, t)
    if op == "avg":
        acc = acc / len(tensors)
    return acc.to(tensors[0].dtype)


def close(a, b, what):
    a = a.cpu()
    assert a.dtype == b.dtype, f"{what}: dtype {a.dtype} != {b.dtype}"
    assert a.shape == b.shape, f"{what}: shape {a.shape} != {b.shape}"
    if a.dtype in MOVE_ONLY:
        ok = torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    elif a.dtype in (torch.float16, torch.bfloat16):
        ok = torch.allclose(a.float(), b.float(), rtol=2e-2, atol=2e-2)
    elif a.is_floating_point() or a.is_complex():
        ok = torch.allclose(a, b, rtol=1e-5, atol=1e-5)
    else:
        ok = torch.equal(a, b)
    assert ok, f"{what}: got {a.flatten()[:8]} expected {b.flatten()[:8]}"


def init(rank, world, port, timeout_s=120, backend="tpu"):
    """init_process_group, choosing the rank's device in the order
    TPU_TEST_INIT_ORDER names: "before" (default) or "after" it, or
    "device_id" (passed to it)."""
    import torch_tpu  # noqa: F401

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dev = torch.device("tpu", rank % torch.tpu.device_count())
    order = os.environ.get("TPU_TEST_INIT_ORDER", "before")
    if order == "before":
        torch.tpu.set_device(dev)
    dist.init_process_group(backend, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s),
                            device_id=dev if order == "device_id" else None)
    if order != "before":
        torch.tpu.set_device(dev)
    return dev


def scenario_collectives(rank, world, port, skip=""):
    """Every collective, reduction op and dtype against a CPU reference
    (`skip`: dtype names, comma-separated, that the backend cannot hold)."""
    dev = init(rank, world, port)
    checked = 0
    for dname, dtype in DTYPES.items():
        if dname in skip.split(","):
            continue
        for oname in (*OPS, *PREMUL):
            if not takes(oname, dtype):
                continue
            shape = (37, 5)
            inputs = [data(r, shape, dtype, seed=checked) for r in range(world)]
            x = inputs[rank].to(dev)
            dist.all_reduce(x, op=reduce_op(oname, rank, dtype, dev))
            close(x, reduce_ref(inputs, oname), f"all_reduce {oname} {dname}")
            checked += 1
        ins = [data(r, (6, 3), dtype, seed=100 + checked) for r in range(world)]
        # broadcast from the last rank
        b = ins[rank].to(dev)
        dist.broadcast(b, src=world - 1)
        close(b, ins[world - 1], f"broadcast {dname}")
        # all_gather (list) and all_gather_into_tensor
        outs = [torch.empty_like(ins[0], device=dev) for _ in range(world)]
        dist.all_gather(outs, ins[rank].to(dev))
        for r in range(world):
            close(outs[r], ins[r], f"all_gather {dname} block {r}")
        flat = torch.empty((world * 6, 3), dtype=dtype, device=dev)
        dist.all_gather_into_tensor(flat, ins[rank].to(dev))
        close(flat, torch.cat(ins), f"all_gather_into_tensor {dname}")
        # gather / scatter with root 1
        root = 1 % world
        glist = [torch.empty_like(ins[0], device=dev) for _ in range(world)] if rank == root else None
        dist.gather(ins[rank].to(dev), glist, dst=root)
        if rank == root:
            for r in range(world):
                close(glist[r], ins[r], f"gather {dname} block {r}")
        sout = torch.empty_like(ins[0], device=dev)
        slist = [data(100 + r, (6, 3), dtype) .to(dev) for r in range(world)] if rank == root else None
        dist.scatter(sout, slist, src=root)
        close(sout, data(100 + rank, (6, 3), dtype), f"scatter {dname}")
        # all_to_all_single, uneven: rank i sends (i + j + 1) rows to rank j
        send_splits = [rank + j + 1 for j in range(world)]
        recv_splits = [i + rank + 1 for i in range(world)]
        src = data(rank, (sum(send_splits), 2), dtype, seed=7)
        out = torch.empty((sum(recv_splits), 2), dtype=dtype, device=dev)
        dist.all_to_all_single(out, src.to(dev), recv_splits, send_splits)
        expect = []
        for i in range(world):
            si = data(i, (sum(i + j + 1 for j in range(world)), 2), dtype, seed=7)
            off = sum(i + j + 1 for j in range(rank))
            expect.append(si[off:off + i + rank + 1])
        close(out, torch.cat(expect), f"all_to_all_single uneven {dname}")
        # all_to_all_single, even: block j of rank i goes to rank j's block i
        src = data(rank, (world * 3, 2), dtype, seed=9)
        out = torch.empty_like(src, device=dev)
        dist.all_to_all_single(out, src.to(dev))
        expect = [data(i, (world * 3, 2), dtype, seed=9)[rank * 3:(rank + 1) * 3] for i in range(world)]
        close(out, torch.cat(expect), f"all_to_all_single even {dname}")
        checked += 5
    # reduce and reduce_scatter_tensor, every dtype and op; reduce_scatter of
    # lists on three dtypes. A non-root's tensor and reduce_scatter's input
    # stay as they were (PREMUL_SUM scales copies of them).
    for dname, dtype in DTYPES.items():
        if dname in skip.split(","):
            continue
        for oname in (*OPS, *PREMUL):
            if not takes(oname, dtype):
                continue
            what = f"{oname} {dname}"
            op = reduce_op(oname, rank, dtype, dev)
            ins = [data(r, (world * 4, 3), dtype, seed=checked) for r in range(world)]
            ref = reduce_ref(ins, oname)
            y = ins[rank].to(dev)
            dist.reduce(y, dst=0, op=op)
            close(y, ref if rank == 0 else ins[rank], f"reduce {what} on rank {rank}")
            src = ins[rank].to(dev)
            rs = torch.empty((4, 3), dtype=dtype, device=dev)
            dist.reduce_scatter_tensor(rs, src, op=op)
            close(rs, ref[rank * 4:(rank + 1) * 4], f"reduce_scatter_tensor {what}")
            close(src, ins[rank], f"reduce_scatter_tensor {what}: its input")
            checked += 2
            if dname in ("float32", "bfloat16", "int64"):
                rl = torch.empty((4, 3), dtype=dtype, device=dev)
                dist.reduce_scatter(rl, [c.to(dev) for c in ins[rank].chunk(world)], op=op)
                close(rl, ref[rank * 4:(rank + 1) * 4], f"reduce_scatter {what}")
                checked += 1
    # PREMUL_SUM as FSDP2 makes it, and with a factor on the CPU
    ins = [data(r, (world * 2, 3), torch.float32, seed=12) for r in range(world)]
    rs = torch.empty((2, 3), device=dev)
    dist.reduce_scatter_tensor(rs, ins[rank].to(dev), op=dist.ReduceOp.PREMUL_SUM(1 / world))
    close(rs, reduce_ref(ins, "avg")[rank * 2:(rank + 1) * 2], "reduce_scatter_tensor PREMUL_SUM(1/n)")
    x = ins[rank].to(dev)
    dist.all_reduce(x, op=dist._make_nccl_premul_sum(torch.tensor(premul_factor("premul_tensor", rank))))
    close(x, reduce_ref(ins, "premul_tensor"), "all_reduce PREMUL_SUM by a CPU tensor")
    # What NCCL and gloo refuse is refused on every rank, naming the op and
    # the dtype, and the group goes on.
    # (all_reduce takes complex tensors as view_as_real, and refuses the
    # bitwise ops on them itself; reduce passes them on.)
    def reduce(t, op):
        dist.reduce(t, dst=0, op=op)

    for call, op, dtype, words in (
            (dist.all_reduce, dist.ReduceOp.BXOR, torch.float32, ("BXOR", "Float")),
            (reduce, dist.ReduceOp.BAND, torch.complex64, ("BAND", "ComplexFloat")),
            (dist.all_reduce, dist._make_nccl_premul_sum(2.0), torch.int32, ("PREMUL_SUM", "Int")),
            (dist.all_reduce, dist.ReduceOp(dist.ReduceOp.RedOpType(9)), torch.float32, ("UNUSED",))):
        try:
            call(torch.ones(4, dtype=dtype, device=dev), op=op)
            torch.tpu.synchronize()
        except RuntimeError as e:
            assert all(w in str(e) for w in words), f"{words}: {e}"
        else:
            raise AssertionError(f"{call.__name__} by {words[0]} of {dtype} succeeded")
    # all_to_all with lists of uneven tensors
    ins = [data(rank * 10 + j, (j + rank + 1,), torch.float32) for j in range(world)]
    outs = [torch.empty((rank + i + 1,), device=dev) for i in range(world)]
    dist.all_to_all(outs, [t.to(dev) for t in ins])
    for i in range(world):
        close(outs[i], data(i * 10 + rank, (rank + i + 1,), torch.float32), f"all_to_all from {i}")
    # send / recv around the ring, and batched both ways
    t = data(rank, (10,), torch.float32, seed=3).to(dev)
    r = torch.empty(10, device=dev)
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    if rank % 2 == 0:
        dist.send(t, nxt)
        dist.recv(r, prv)
    else:
        dist.recv(r, prv)
        dist.send(t, nxt)
    close(r, data(prv, (10,), torch.float32, seed=3), "send/recv")
    a, b = torch.empty(10, device=dev), torch.empty(10, device=dev)
    reqs = dist.batch_isend_irecv([
        dist.P2POp(dist.isend, t, nxt), dist.P2POp(dist.irecv, a, prv),
        dist.P2POp(dist.isend, t * 2, prv), dist.P2POp(dist.irecv, b, nxt)])
    for q in reqs:
        q.wait()
    close(a, data(prv, (10,), torch.float32, seed=3), "batch_isend_irecv forward")
    close(b, 2 * data(nxt, (10,), torch.float32, seed=3), "batch_isend_irecv backward")
    # coalesced all_reduces, and a non-contiguous tensor
    xs = [data(rank, (5, 4), torch.float32, seed=s).to(dev) for s in (1, 2, 3)]
    with dist._coalescing_manager(async_ops=True) as cm:
        for x in xs:
            dist.all_reduce(x)
    cm.wait()
    for s, x in zip((1, 2, 3), xs):
        close(x, reduce_ref([data(q, (5, 4), torch.float32, seed=s) for q in range(world)], "sum"),
              f"coalesced all_reduce {s}")
    nc = data(rank, (6, 8), torch.float32, seed=9).to(dev).t()
    dist.all_reduce(nc)
    close(nc, reduce_ref([data(q, (6, 8), torch.float32, seed=9) for q in range(world)], "sum").t(),
          "non-contiguous all_reduce")
    # Work objects
    w = dist.all_reduce(torch.ones(4, device=dev), async_op=True)
    w.wait()
    torch.tpu.synchronize()
    assert w.is_completed()
    # a sub-group of the even ranks
    evens = list(range(0, world, 2))
    sub = dist.new_group(evens)
    if rank in evens:
        z = torch.full((3,), float(rank), device=dev)
        dist.all_reduce(z, group=sub)
        close(z, torch.full((3,), float(sum(evens))), "sub-group all_reduce")
    # object collectives
    objs = [None] * world
    dist.all_gather_object(objs, {"rank": rank, "name": f"r{rank}"})
    assert objs == [{"rank": r, "name": f"r{r}"} for r in range(world)], objs
    lst = [f"from {rank}", rank] if rank == 0 else [None, None]
    dist.broadcast_object_list(lst, src=0)
    assert lst == ["from 0", 0], lst
    dist.barrier()
    torch.tpu.synchronize()
    dist.destroy_process_group()
    return {"checked": checked}


def scenario_mismatch(rank, world, port):
    """Rank 1 passes a different size: every rank fails naming it, and goes on."""
    dev = init(rank, world, port)
    n = 512 if rank == 1 else 1024
    x = torch.ones(n, device=dev)
    err = None
    try:
        dist.all_reduce(x)
        torch.tpu.synchronize()
    except RuntimeError as e:
        err = str(e)
    assert err is not None, "a mismatched all_reduce succeeded"
    y = torch.ones(8, device=dev)
    dist.all_reduce(y)
    close(y, torch.full((8,), float(world)), "all_reduce after a mismatch")
    dtype_err = None
    z = torch.ones(8, device=dev, dtype=torch.float16 if rank == 2 % world else torch.float32)
    try:
        dist.all_reduce(z)
        torch.tpu.synchronize()
    except RuntimeError as e:
        dtype_err = str(e)
    dist.destroy_process_group()
    return {"error": err, "dtype_error": dtype_err}


def scenario_killed(rank, world, port):
    """The last rank dies while the others wait in an all_reduce."""
    dev = init(rank, world, port)
    x = torch.ones(1000, device=dev)
    dist.all_reduce(x)
    torch.tpu.synchronize()
    if rank == world - 1:
        print(json.dumps({"ok": True, "pid": os.getpid()}), flush=True)
        time.sleep(1.0)
        os.kill(os.getpid(), 9)
    t0 = time.time()
    err = None
    try:
        dist.all_reduce(x)
        torch.tpu.synchronize()
    except RuntimeError as e:
        err = str(e)
    return {"error": err, "seconds": time.time() - t0}


def scenario_timeout(rank, world, port, first=""):
    """Rank 0 never calls: the others fail after the group's timeout naming it
    (with `first`, at the group's first collective, which forms it)."""
    dev = init(rank, world, port, timeout_s=3)
    x = torch.ones(10, device=dev)
    if not first:
        dist.all_reduce(x)
        torch.tpu.synchronize()
    if rank == 0:
        time.sleep(8)
        return {"error": None, "seconds": 0}
    t0 = time.time()
    err = None
    try:
        dist.all_reduce(x)
        torch.tpu.synchronize()
    except RuntimeError as e:
        err = str(e)
    return {"error": err, "seconds": time.time() - t0}


def scenario_job(rank, world, port, chips):
    """One job of two running at once on its own chips (TPU_VISIBLE_CHIPS)."""
    dev = init(rank, world, port)
    total = 0.0
    for i in range(50):
        x = torch.full((4096,), float(rank + i), device=dev)
        dist.all_reduce(x)
        total += x[0].item()
    expect = sum(sum(r + i for r in range(world)) for i in range(50))
    assert total == expect, (total, expect)
    dist.destroy_process_group()
    return {"total": total}




def scenario_default_backend(rank, world, port):
    """init_process_group() naming no backend: "cpu:gloo,tpu:tpu"."""
    dev = init(rank, world, port, backend=None)
    pg = dist.group.WORLD
    assert pg._get_backend(torch.device("tpu")).name() == "tpu"
    assert pg._get_backend(torch.device("cpu")).name() == "gloo"
    x = torch.full((8,), float(rank + 1), device=dev)
    dist.all_reduce(x)
    c = torch.full((8,), float(rank + 1))
    dist.all_reduce(c)
    expect = float(sum(range(1, world + 1)))
    assert x.cpu().tolist() == [expect] * 8 and c.tolist() == [expect] * 8, (x.cpu(), c)
    objs = [None] * world
    dist.all_gather_object(objs, {"rank": rank})
    assert objs == [{"rank": r} for r in range(world)], objs
    sub = dist.new_group([0, 1])  # no backend either: the same pair
    if rank in (0, 1):
        y = torch.ones(4, device=dev) * (rank + 1)
        dist.all_reduce(y, group=sub)
        assert y.cpu().tolist() == [3.0] * 4, y.cpu()
        z = torch.ones(2) * (rank + 1)
        dist.all_reduce(z, group=sub)
        assert z.tolist() == [3.0] * 2, z
    dist.barrier()
    dist.destroy_process_group()


def scenario_p2p_first(rank, world, port):
    """Two ranks' send/recv is the group's first operation; the others wait."""
    dev = init(rank, world, port, timeout_s=60)
    if rank in (0, 1):
        t = torch.full((6,), float(rank + 1), device=dev)
        if rank == 0:
            dist.send(t, 1)
        else:
            dist.recv(t, 0)
        assert t.cpu().tolist() == [1.0] * 6, t.cpu()
    store = dist.distributed_c10d._get_default_store()
    if rank == 1:
        store.set("p2p_done", "1")
    else:
        store.get("p2p_done")  # ranks 2 and 3 touch the group only after the pair is done
    dist.barrier()
    dist.destroy_process_group()


def _same_as_gloo(fn, dev, what):
    """fn(device) -> tensors, run on tpu and then on the CPU, where the group
    ("cpu:gloo,tpu:tpu") runs it by gloo: the two must agree."""
    got = fn(dev)
    for i, (a, b) in enumerate(zip(got, fn(torch.device("cpu")))):
        close(a, b, f"{what} [{i}] against gloo")
    return got


def scenario_c10d_data(rank, world, port):
    """batch_isend_irecv, coalesced collectives, and the tensor forms and
    uneven sizes torch allows, on the group init_process_group() makes
    ("cpu:gloo,tpu:tpu"): tpu against gloo on the CPU where gloo takes the
    call, against values computed here where it does not."""
    assert world == 4, "written for 4 ranks"
    dev = init(rank, world, port, backend=None)
    f32 = torch.float32
    nxt, prv = (rank + 1) % world, (rank - 1) % world

    # batch_isend_irecv: a ring as the tpu backend's first operation ...
    def ring(d):
        got = torch.empty(5, device=d)
        for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, data(rank, (5,), f32, seed=20).to(d), nxt),
                                         dist.P2POp(dist.irecv, got, prv)]):
            w.wait()
        return [got]

    close(ring(dev)[0], data(prv, (5,), f32, seed=20), "batch_isend_irecv ring, first operation")
    _same_as_gloo(ring, dev, "batch_isend_irecv ring")

    # ... rank 0 with every other rank (a size per peer), 1 and 3 with each
    # other too, receives before sends on some ranks ...
    def star(d):
        peers = list(range(1, world)) if rank == 0 else [0] + ([4 - rank] if rank in (1, 3) else [])
        ops, got = [], []
        for p in peers:
            n = 2 + rank + p
            got.append(torch.empty(n, device=d))
            send = dist.P2POp(dist.isend, data(10 * rank + p, (n,), f32).to(d), p)
            recv = dist.P2POp(dist.irecv, got[-1], p)
            ops += [recv, send] if rank % 2 else [send, recv]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        for p, t in zip(peers, got):
            close(t, data(10 * p + rank, (2 + rank + p,), f32), f"batch from rank {p}")
        return got

    _same_as_gloo(star, dev, "batch_isend_irecv with several peers")

    # ... and after collectives, batches among some of the ranks only.
    x = torch.full((3,), float(rank), device=dev)
    dist.all_reduce(x)

    def pairs(d):
        got = torch.empty(4, device=d)
        peer = rank ^ 1
        send = dist.P2POp(dist.isend, torch.full((4,), float(rank), device=d), peer)
        recv = dist.P2POp(dist.irecv, got, peer)
        # ranks 0 and 1 in one batch each; 2 and 3 one operation a batch
        batches = [[send, recv]] if rank < 2 else [[send], [recv]] if rank == 2 else [[recv], [send]]
        for ops in batches:
            for w in dist.batch_isend_irecv(ops):
                w.wait()
        close(got, torch.full((4,), float(peer)), "batch between two ranks")
        return [got]

    _same_as_gloo(pairs, dev, "batch_isend_irecv between pairs")
    dist.all_reduce(x)
    close(x, torch.full((3,), float(world * sum(range(world)))), "all_reduce after the batches")

    # Coalesced: _coalescing_manager (torch's fast path, and on a device:
    # start/end coalescing), all_reduce_coalesced, all_gather_coalesced.
    def coalesced(d, on_device=False, async_ops=True):
        kw = {"device": d} if on_device else {}
        ar = [data(rank, (n,), f32, seed=21).to(d) for n in (3, 70000)]
        ag = [torch.empty(world * n, device=d) for n in (2, 5)]
        rs = [torch.empty(n, device=d) for n in (2, 5)]
        for body in (lambda: [dist.all_reduce(t) for t in ar],
                     lambda: [dist.all_gather_into_tensor(o, data(rank, (o.numel() // world,), f32, seed=22).to(d))
                              for o in ag],
                     lambda: [dist.reduce_scatter_tensor(o, data(rank, (world * o.numel(),), f32, seed=23).to(d))
                              for o in rs]):
            with dist._coalescing_manager(async_ops=async_ops, **kw) as cm:
                body()
            if async_ops:
                cm.wait()
        return ar + ag + rs

    outs = _same_as_gloo(coalesced, dev, "_coalescing_manager")
    close(outs[1], reduce_ref([data(r, (70000,), f32, seed=21) for r in range(world)], "sum"), "coalesced all_reduce")
    close(outs[3], torch.cat([data(r, (5,), f32, seed=22) for r in range(world)]), "coalesced all_gather")
    close(outs[5], reduce_ref([data(r, (20,), f32, seed=23) for r in range(world)], "sum")[rank * 5:rank * 5 + 5],
          "coalesced reduce_scatter")
    for got, expect in zip(coalesced(dev, async_ops=False), outs):
        close(got, expect.cpu(), "_coalescing_manager, blocking")
    for got, expect in zip(coalesced(dev, on_device=True), outs):  # gloo has no start/end coalescing
        close(got, expect.cpu(), "_coalescing_manager on a device")
    b, y = data(rank, (6,), f32).to(dev), data(rank, (4,), f32).to(dev)
    with dist._coalescing_manager(device=dev, async_ops=True) as cm:
        dist.broadcast(b, src=2)
        dist.all_reduce(y)
    cm.wait()
    close(b, data(2, (6,), f32), "broadcast coalesced with an all_reduce")
    close(y, reduce_ref([data(r, (4,), f32) for r in range(world)], "sum"), "all_reduce coalesced with a broadcast")

    def coalesced_lists(d):
        ts = [data(rank, (3, 2), f32, seed=24).to(d), data(rank, (7,), f32, seed=24).to(d)]
        dist.all_reduce_coalesced(ts, op=dist.ReduceOp.MAX)
        # all_gather_coalesced: outs[r][i] is rank r's input i
        outs = [[torch.empty(2, 3, device=d), torch.empty(4, device=d)] for _ in range(world)]
        dist.all_gather_coalesced(outs, [data(rank, (2, 3), f32, seed=25).to(d),
                                         data(rank, (4,), f32, seed=26).to(d)])
        return ts + [t for per_rank in outs for t in per_rank]

    outs = _same_as_gloo(coalesced_lists, dev, "all_reduce_coalesced, all_gather_coalesced")
    close(outs[1], reduce_ref([data(r, (7,), f32, seed=24) for r in range(world)], "max"),
          "all_reduce_coalesced MAX")
    for r in range(world):
        close(outs[2 + 2 * r], data(r, (2, 3), f32, seed=25), f"all_gather_coalesced rank {r} input 0")
        close(outs[3 + 2 * r], data(r, (4,), f32, seed=26), f"all_gather_coalesced rank {r} input 1")

    # all_gather_into_tensor / reduce_scatter_tensor: stacked [world, n] and
    # flat (gloo takes the flat ones only).
    ins = [data(r, (3,), f32, seed=27) for r in range(world)]
    for out_shape, in_shape in (((world, 3), (3,)), ((world, 3), (1, 3)), ((world * 3,), (3,))):
        out = torch.empty(out_shape, device=dev)
        dist.all_gather_into_tensor(out, ins[rank].view(in_shape).to(dev))
        close(out, torch.stack(ins).view(out_shape), f"all_gather_into_tensor {out_shape} from {in_shape}")
    big = [data(r, (world, 3), f32, seed=28) for r in range(world)]
    for in_shape in ((world, 3), (world * 3,)):
        out = torch.empty(3, device=dev)
        dist.reduce_scatter_tensor(out, big[rank].view(in_shape).to(dev))
        close(out, reduce_ref(big, "sum")[rank], f"reduce_scatter_tensor from {in_shape}")

    # Uneven lists: all_gather (gloo refuses), reduce_scatter, all_to_all_single.
    outs = [torch.empty(r + 1, 2, device=dev) for r in range(world)]
    dist.all_gather(outs, data(rank, (rank + 1, 2), f32, seed=29).to(dev))
    for r in range(world):
        close(outs[r], data(r, (r + 1, 2), f32, seed=29), f"uneven all_gather, rank {r}'s part")

    def uneven(d):
        res = []
        for dtype, op in ((f32, dist.ReduceOp.SUM), (torch.int64, dist.ReduceOp.MAX),
                          (f32, dist.ReduceOp.PRODUCT)):
            parts = [data(10 * rank + j, (j + 2,), dtype, seed=30).to(d) for j in range(world)]
            out = torch.empty(rank + 2, dtype=dtype, device=d)
            dist.reduce_scatter(out, parts, op=op)
            res.append(out)
        send = [rank + j + 1 for j in range(world)]
        recv = [i + rank + 1 for i in range(world)]
        out = torch.empty(sum(recv), 2, device=d)
        dist.all_to_all_single(out, data(rank, (sum(send), 2), f32, seed=31).to(d), recv, send)
        return res + [out]

    res = _same_as_gloo(uneven, dev, "uneven reduce_scatter and all_to_all_single")
    close(res[0], reduce_ref([data(10 * r + rank, (rank + 2,), f32, seed=30) for r in range(world)], "sum"),
          "uneven reduce_scatter")
    dist.destroy_process_group()


def scenario_c10d_waits(rank, world, port):
    """Work.wait with a timeout, async_op, and monitored_barrier, on the
    group init_process_group() makes ("cpu:gloo,tpu:tpu") and on a group of
    the "tpu" backend alone. The last rank comes late."""
    dev = init(rank, world, port, backend=None)
    store = dist.distributed_c10d._get_default_store()
    last = world - 1
    w = dist.all_reduce(torch.full((4,), float(rank), device=dev), async_op=True)
    w.wait()
    assert w.wait(timeout=datetime.timedelta(seconds=5))
    dist.monitored_barrier(timeout=datetime.timedelta(seconds=30))
    # A wait with a timeout while the last rank has not come: an error naming
    # the collective, at that timeout. The collective stays posted and runs
    # when that rank comes.
    x = torch.full((4,), float(rank), device=dev)
    result = {}
    if rank != last:
        t0 = time.time()
        work = dist.all_reduce(x, async_op=True)
        try:
            work.wait(timeout=datetime.timedelta(seconds=1.5))
        except dist.DistBackendError as e:
            result["wait_error"] = str(e)
        result["wait_seconds"] = time.time() - t0
        store.set(f"timed_out/{rank}", "1")
    else:
        store.wait([f"timed_out/{r}" for r in range(last)], datetime.timedelta(seconds=60))
        dist.all_reduce(x)
    torch.tpu.synchronize()
    close(x, torch.full((4,), float(sum(range(world)))), "all_reduce once the late rank came")
    # monitored_barrier: the "tpu" backend alone gives torch's own error ...
    tpu_only = dist.new_group(backend="tpu")
    try:
        dist.monitored_barrier(group=tpu_only, timeout=datetime.timedelta(seconds=5))
    except ValueError as e:
        result["tpu_only_error"] = str(e)
    # ... the default group names the rank that does not come (which waits
    # until the others gave up, lest its leaving end their wait first).
    if rank != last:
        try:
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=1.5), wait_all_ranks=True)
        except RuntimeError as e:
            result["monitored_error"] = str(e)
        store.set(f"monitored/{rank}", "1")
    else:
        store.wait([f"monitored/{r}" for r in range(last)], datetime.timedelta(seconds=60))
    dist.destroy_process_group()
    return result


def scenario_c10d_groups(rank, world, port, backend):
    """new_group, split_group, init_device_mesh("tpu", (2, 2)) and its
    sub-meshes, DeviceMesh._flatten, and the object collectives on each, on
    a world group of `backend` ("tpu", or "default": "cpu:gloo,tpu:tpu").
    With TPU_TEST_INIT_ORDER=device_id the world group has a device, so
    torch splits groups from it (and refuses split_group otherwise)."""
    from torch.distributed.device_mesh import init_device_mesh

    assert world == 4, "written for 4 ranks"
    dev = init(rank, world, port, backend=None if backend == "default" else backend)
    bound = os.environ.get("TPU_TEST_INIT_ORDER") == "device_id"

    def check_group(g, ranks, what):
        assert g is not None and g != dist.GroupMember.NON_GROUP_MEMBER, what
        assert dist.get_process_group_ranks(g) == ranks, (what, dist.get_process_group_ranks(g))
        assert g._get_backend(dev).name() == "tpu", what
        x = torch.full((3,), float(rank + 1), device=dev)
        dist.all_reduce(x, group=g)
        close(x, torch.full((3,), float(sum(r + 1 for r in ranks))), f"all_reduce on {what}")
        out = torch.empty(len(ranks), 2, device=dev)
        dist.all_gather_into_tensor(out, torch.full((2,), float(rank), device=dev), group=g)
        close(out, torch.tensor(ranks, dtype=torch.float32)[:, None].expand(-1, 2), f"all_gather on {what}")
        # the object collectives move their bytes through tpu tensors (the
        # "tpu" backend alone) or by gloo (the default)
        objs = [None] * len(ranks)
        dist.all_gather_object(objs, {"rank": rank}, group=g)
        assert objs == [{"rank": r} for r in ranks], (what, objs)
        root = ranks[-1]
        lst = [f"from {rank}", [rank]] if rank == root else [None, None]
        dist.broadcast_object_list(lst, src=root, group=g)
        assert lst == [f"from {root}", [root]], (what, lst)
        gathered = [None] * len(ranks) if rank == root else None
        dist.gather_object(("r", rank), gathered, dst=root, group=g)
        if rank == root:
            assert gathered == [("r", r) for r in ranks], (what, gathered)
        mine = [None]
        dist.scatter_object_list(mine, [{"to": r} for r in ranks] if rank == root else None, src=root, group=g)
        assert mine == [{"to": rank}], (what, mine)

    check_group(dist.group.WORLD, list(range(world)), "the world group")

    def mesh_and_splits(what):
        mesh = init_device_mesh("tpu", (2, 2), mesh_dim_names=("dp", "tp"))
        check_group(mesh["dp"].get_group(), [rank % 2, rank % 2 + 2], f"mesh['dp']{what}")
        check_group(mesh["tp"].get_group(), [rank // 2 * 2, rank // 2 * 2 + 1], f"mesh['tp']{what}")
        check_group(mesh._flatten().get_group(), list(range(world)), f"the flattened mesh{what}")
        if not bound:
            return
        for splits in ([[0, 1], [2, 3]], [[0, 2]]):
            g = dist.split_group(split_ranks=splits)
            mine = [s for s in splits if rank in s]
            if mine:
                check_group(g, mine[0], f"split_group {splits}{what}")
            else:
                assert g is None, g

    mesh_and_splits("")
    # new_group: every rank calls it, members or not (with a device, the
    # others take part in torch's split of the world group).
    for ranks in ([1, 3], [0, 2, 3]):
        g = dist.new_group(ranks)
        if rank in ranks:
            check_group(g, ranks, f"new_group {ranks}")
        else:
            assert g == dist.GroupMember.NON_GROUP_MEMBER, g
    if backend == "tpu":
        # torch now names a split's store differently on the ranks (its
        # name counts the groups each process knows, and the ranks outside
        # a group count one fewer): the tpu backend numbers its splits
        # itself. (gloo, the default group's CPU part, waits for ever.)
        mesh_and_splits(" after new_group")
    dist.barrier()
    dist.destroy_process_group()


def scenario_shared_chip(rank, world, port):
    """No rank sets its device: every rank is on tpu:0, which the first
    collective refuses on every rank, naming them (TPU_DIST_SHARED_CHIPS=1
    allows it)."""
    import torch_tpu  # noqa: F401

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("tpu", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    x = torch.full((4,), float(rank + 1), device="tpu")
    err = None
    try:
        dist.all_reduce(x)
        torch.tpu.synchronize()
    except dist.DistBackendError as e:
        err = str(e)
    result = {"error": err}
    if err is None:
        result["sum"] = x.cpu().tolist()
    dist.destroy_process_group()
    return result


def scenario_other_device(rank, world, port):
    """After the group's first collective on the rank's device, a collective
    on another device fails at the call, naming both; the group goes on."""
    dev = init(rank, world, port, timeout_s=60)
    x = torch.ones(4, device=dev)
    dist.all_reduce(x)
    other = torch.device("tpu", (dev.index + 1) % torch.tpu.device_count())
    err = None
    try:
        dist.all_reduce(torch.ones(4, device=other))
    except dist.DistBackendError as e:
        err = str(e)
    dist.all_reduce(x)
    close(x, torch.full((4,), float(world * world)), "all_reduce after the refused call")
    dist.destroy_process_group()
    return {"error": err}


def scenario_many_groups(rank, world, port, count):
    """`count` groups made, used and destroyed in turn while every one of them
    is still referenced (as FSDP and DeviceMesh keep theirs): each one's
    communicator goes back to tpud at destroy_process_group."""
    dev = init(rank, world, port)
    kept = []
    t0 = time.time()
    for i in range(int(count)):
        g = dist.new_group(list(range(world)))
        x = torch.full((2,), float(i + rank), device=dev)
        dist.all_reduce(x, group=g)
        if i % 100 == 0:
            assert x[0].item() == world * i + sum(range(world)), (i, x.cpu())
        dist.destroy_process_group(g)
        kept.append(g)
    seconds = time.time() - t0
    err = None
    try:  # the group object itself, as a framework holding it would call it
        kept[-1].allreduce([torch.ones(2, device=dev)]).wait()
    except RuntimeError as e:
        err = str(e)
    dist.destroy_process_group()
    return {"seconds": seconds, "destroyed_error": err}


def scenario_table_full(rank, world, port, slots):
    """With tpud's table of `slots` communicators full, the next group's first
    collective fails naming the processes holding them; destroying a group
    frees its slot at once."""
    dev = init(rank, world, port, timeout_s=60)
    groups = [dist.new_group(list(range(world))) for _ in range(int(slots) + 1)]
    for g in groups[:-1]:
        dist.all_reduce(torch.ones(2, device=dev), group=g)
    err = None
    try:
        dist.all_reduce(torch.ones(2, device=dev), group=groups[-1])
    except RuntimeError as e:
        err = str(e)
    dist.destroy_process_group(groups[0])
    again = dist.new_group(list(range(world)))
    x = torch.ones(2, device=dev)
    dist.all_reduce(x, group=again)
    close(x, torch.full((2,), float(world)), "all_reduce after a slot was freed")
    return {"error": err, "pid": os.getpid()}


def scenario_staggered_exit(rank, world, port):
    """Every rank destroys the group and exits, rank 0 last (as TorchTitan's
    rank 0 sleeps before tearing down): no communicator fails."""
    dev = init(rank, world, port)
    x = torch.ones(4, device=dev)
    dist.all_reduce(x)
    close(x, torch.full((4,), float(world)), "all_reduce")
    if rank == 0:
        time.sleep(1.5)
    dist.destroy_process_group()


def _mlp(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32),
                               torch.nn.ReLU(), torch.nn.Linear(32, 4))


def _batches(steps, world, per_rank):
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(world * per_rank, 16, generator=g), torch.randn(world * per_rank, 4, generator=g))
            for _ in range(steps)]


def _reference(steps, world, per_rank, lr=0.05):
    """Single-process training on the CPU over the whole global batch."""
    model = _mlp(0)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    losses = []
    for x, y in _batches(steps, world, per_rank):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return model, losses


def _train_like_one_process(model, params, rank, world, dev, steps, per_rank, what):
    """SGD-momentum steps on this rank's shard of each global batch: the
    averaged loss and the final parameters (`params()`: name, full tensor)
    must equal one CPU process over the whole batch."""
    ref_model, ref_losses = _reference(steps, world, per_rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step, (x, y) in enumerate(_batches(steps, world, per_rank)):
        xs, ys = x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(xs.to(dev)), ys.to(dev))
        loss.backward()
        opt.step()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss, op=dist.ReduceOp.AVG)
        assert abs(global_loss.item() - ref_losses[step]) < 1e-4, (step, global_loss.item(), ref_losses[step])
    for (name, p), q in zip(params(), ref_model.parameters()):
        close(p.detach(), q.detach(), f"{what} parameter {name}")
    return ref_losses


def scenario_ddp(rank, world, port):
    """DistributedDataParallel over tpu ranks equals one process, step for step."""
    dev = init(rank, world, port)
    model = torch.nn.parallel.DistributedDataParallel(_mlp(0).to(dev))
    losses = _train_like_one_process(model, model.module.named_parameters, rank, world, dev,
                                     steps=5, per_rank=8, what="DDP")
    dist.destroy_process_group()
    return {"losses": losses}


def scenario_fsdp(rank, world, port):
    """FSDP2 (fully_shard) over tpu ranks equals one process, step for step."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dev = init(rank, world, port)
    mesh = init_device_mesh("tpu", (world,))
    model = _mlp(0).to(dev)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    params = lambda: ((n, p.full_tensor()) for n, p in model.named_parameters())  # noqa: E731
    losses = _train_like_one_process(model, params, rank, world, dev, steps=5, per_rank=8,
                                     what="FSDP")
    dist.destroy_process_group()
    return {"losses": losses}


def scenario_dtensor(rank, world, port):
    """DTensor: shard, redistribute and a distributed matmul, against the CPU."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    init(rank, world, port)
    mesh = init_device_mesh("tpu", (world,))
    a = data(0, (8, 12), torch.float32, seed=11)
    b = data(1, (12, 6), torch.float32, seed=11)
    da = distribute_tensor(a, mesh, [Shard(0)])
    assert da.to_local().shape == (8 // world, 12), da.to_local().shape
    close(da.redistribute(mesh, [Replicate()]).to_local(), a, "Shard(0) -> Replicate")
    db = distribute_tensor(b, mesh, [Replicate()])
    close((da @ db).full_tensor(), a @ b, "row-sharded matmul")
    dc = distribute_tensor(a, mesh, [Shard(1)])
    dd = distribute_tensor(b, mesh, [Shard(0)])
    close((dc @ dd).full_tensor(), a @ b, "contraction-sharded matmul (partial sums)")
    close(da.redistribute(mesh, [Shard(1)]).full_tensor(), a, "Shard(0) -> Shard(1)")
    dist.destroy_process_group()
    return {}


def scenario_multihost(rank, world, port):
    """Under torchrun across two tpuds (hosts): collectives and DDP equal one host."""
    import torch_tpu  # noqa: F401

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ["LOCAL_RANK"])
    torch.tpu.set_device(local)
    dev = torch.device("tpu", local)
    dist.init_process_group("tpu", timeout=datetime.timedelta(seconds=120))
    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.bool):
        for oname in (*OPS, *PREMUL):
            if not takes(oname, dtype) or (dtype == torch.bool and oname not in BITWISE):
                continue
            ins = [data(r, (33, 3), dtype, seed=5) for r in range(world)]
            x = ins[rank].to(dev)
            dist.all_reduce(x, op=reduce_op(oname, rank, dtype, dev))
            close(x, reduce_ref(ins, oname), f"all_reduce {oname} {dtype} across hosts")
    ins = [data(r, (4, 3), torch.float32, seed=6) for r in range(world)]
    b = ins[rank].to(dev)
    dist.broadcast(b, src=world - 3)
    close(b, ins[world - 3], "broadcast across hosts")
    outs = [torch.empty(4, 3, device=dev) for _ in range(world)]
    dist.all_gather(outs, ins[rank].to(dev))
    for r in range(world):
        close(outs[r], ins[r], f"all_gather block {r} across hosts")
    flat = torch.empty(world * 4, 3, device=dev)
    dist.all_gather_into_tensor(flat, ins[rank].to(dev))
    close(flat, torch.cat(ins), "all_gather_into_tensor across hosts")
    big = [data(r, (world * 2, 3), torch.float32, seed=8) for r in range(world)]
    rs = torch.empty(2, 3, device=dev)
    dist.reduce_scatter_tensor(rs, big[rank].to(dev))
    close(rs, reduce_ref(big, "sum")[rank * 2:(rank + 1) * 2], "reduce_scatter_tensor across hosts")
    red = big[rank].to(dev)
    dist.reduce(red, dst=6 % world)
    if rank == 6 % world:
        close(red, reduce_ref(big, "sum"), "reduce across hosts")
    for oname in ("premul_tensor", "bxor"):
        dtype = torch.float32 if oname in PREMUL else torch.int64
        pins = [data(r, (world * 2, 3), dtype, seed=8) for r in range(world)]
        op = reduce_op(oname, rank, dtype, dev)
        src = pins[rank].to(dev)
        rs = torch.empty(2, 3, dtype=dtype, device=dev)
        dist.reduce_scatter_tensor(rs, src, op=op)
        close(rs, reduce_ref(pins, oname)[rank * 2:(rank + 1) * 2],
              f"reduce_scatter_tensor {oname} across hosts")
        close(src, pins[rank], f"reduce_scatter_tensor {oname} across hosts: its input")
        red = pins[rank].to(dev)
        dist.reduce(red, dst=6 % world, op=op)
        close(red, reduce_ref(pins, oname) if rank == 6 % world else pins[rank],
              f"reduce {oname} across hosts on rank {rank}")
    # coalesced, and uneven lists, across hosts
    ag = [torch.empty(world * n, device=dev) for n in (2, 3)]
    rs = [torch.empty(n, device=dev) for n in (2, 3)]
    with dist._coalescing_manager(async_ops=True) as cm:
        for o in ag:
            dist.all_gather_into_tensor(o, torch.full((o.numel() // world,), float(rank), device=dev))
    cm.wait()
    with dist._coalescing_manager(async_ops=True) as cm:
        for o in rs:
            dist.reduce_scatter_tensor(o, torch.full((world * o.numel(),), float(rank), device=dev))
    cm.wait()
    for o, r in zip(ag, rs):
        n = r.numel()
        close(o, torch.arange(world, dtype=torch.float32).repeat_interleave(n), "coalesced all_gather across hosts")
        close(r, torch.full((n,), float(sum(range(world)))), "coalesced reduce_scatter across hosts")
    agc = [[torch.empty(2, device=dev), torch.empty(3, device=dev)] for _ in range(world)]
    dist.all_gather_coalesced(agc, [torch.full((2,), float(rank), device=dev),
                                    torch.full((3,), -float(rank), device=dev)])
    uneven = [torch.empty(r % 3 + 1, device=dev) for r in range(world)]
    dist.all_gather(uneven, torch.full((rank % 3 + 1,), float(rank), device=dev))
    for r in range(world):
        close(agc[r][0], torch.full((2,), float(r)), f"all_gather_coalesced from {r} across hosts")
        close(agc[r][1], torch.full((3,), -float(r)), f"all_gather_coalesced from {r} across hosts")
        close(uneven[r], torch.full((r % 3 + 1,), float(r)), f"uneven all_gather from {r} across hosts")
    rsu = torch.empty(rank % 3 + 1, device=dev)
    dist.reduce_scatter(rsu, [torch.full((r % 3 + 1,), float(rank), device=dev) for r in range(world)])
    close(rsu, torch.full((rank % 3 + 1,), float(sum(range(world)))), "uneven reduce_scatter across hosts")
    glist = [torch.empty(4, 3, device=dev) for _ in range(world)] if rank == 1 else None
    dist.gather(ins[rank].to(dev), glist, dst=1)
    if rank == 1:
        for r in range(world):
            close(glist[r], ins[r], f"gather block {r} across hosts")
    sout = torch.empty(4, 3, device=dev)
    dist.scatter(sout, [i.to(dev) for i in ins] if rank == world - 1 else None, src=world - 1)
    close(sout, ins[rank], "scatter across hosts")
    # all_to_all with uneven splits: rank i sends j+1 rows to rank j
    a2a_in = torch.cat([torch.full((j + 1, 2), float(100 * rank + j)) for j in range(world)])
    a2a_out = torch.empty(world * (rank + 1), 2, device=dev)
    dist.all_to_all_single(a2a_out, a2a_in.to(dev), output_split_sizes=[rank + 1] * world,
                           input_split_sizes=[j + 1 for j in range(world)])
    close(a2a_out, torch.cat([torch.full((rank + 1, 2), float(100 * i + rank))
                              for i in range(world)]), "uneven all_to_all_single across hosts")
    lists_out = [torch.empty(3, device=dev) for _ in range(world)]
    dist.all_to_all(lists_out, [torch.full((3,), float(10 * rank + j), device=dev)
                                for j in range(world)])
    for i in range(world):
        close(lists_out[i], torch.full((3,), float(10 * i + rank)), f"all_to_all from {i}")
    # a ring of batched sends and receives over all ranks: hops 3->4 and
    # 7->0 cross hosts (ranks 0-3 on one tpud, 4-7 on the other) ...
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    got = torch.empty(5, device=dev)
    reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.full((5,), float(rank), device=dev), nxt),
                                   dist.P2POp(dist.irecv, got, prv)])
    for r in reqs:
        r.wait()
    close(got, torch.full((5,), float(prv)), "batch_isend_irecv ring across hosts")
    # ... and plain blocking send/recv: across hosts (i <-> i+4) and inside one
    half = world // 2
    for peer in ((rank + half) % world, rank ^ 1):
        t = torch.full((4,), float(rank * 7), device=dev)
        back = torch.empty(4, device=dev)
        if rank < peer:
            dist.send(t, peer)
            dist.recv(back, peer)
        else:
            dist.recv(back, peer)
            dist.send(t, peer)
        close(back, torch.full((4,), float(peer * 7)), f"send/recv with rank {peer}")
    dist.barrier()
    # DDP over both hosts against one CPU process
    model = torch.nn.parallel.DistributedDataParallel(_mlp(0).to(dev))
    _train_like_one_process(model, model.module.named_parameters, rank, world, dev, steps=4,
                            per_rank=4, what="DDP across hosts")
    dist.destroy_process_group()
    return {"rank": rank}


SCENARIOS = {k[len("scenario_"):]: v for k, v in globals().items() if k.startswith("scenario_")}



def main():
    name, rank, world, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    extra = sys.argv[5:]
    result = SCENARIOS[name](rank, world, port, *extra)
    print(json.dumps({"ok": True, **(result or {})}), flush=True)


if __name__ == "__main__":
    main()
