"""Minimal repro emitted by `tic locate` (C4): _vllm_fa3_C.fwd.default in model.layers.0.self_attn.attn differs between the two sides on identical inputs

Side A: rollout decode (vllm, KV cache, one token per step)
Side B: rollout prefill scoring (vllm, teacher-forced forward)
Operator: _vllm_fa3_C.fwd.default
Rows (tokens): side A 1, side B 158

Needs torch and vllm.vllm_flash_attn._vllm_fa3_C (the operators' kernels) on the same kind of device. Exit 1 while the two values differ in any bit, 0 once they are identical, 3 if the repro itself is broken.
"""
import os
import sys

import torch
import vllm.vllm_flash_attn._vllm_fa3_C  # noqa: F401  registers torch.ops._vllm_fa3_C

HERE = os.path.dirname(os.path.abspath(__file__))
torch.set_num_threads(16)  # kernel choice on CPU depends on the thread count of the run


def resolve(name):
    ns, op, overload = name.split(".")
    return getattr(getattr(getattr(torch.ops, ns), op), overload)


def outputs_of(op, args, kwargs):
    # returned tensors, then the arguments the operator writes in place (some kernels return nothing)
    ret = op(*args, **kwargs)
    if isinstance(ret, torch.Tensor):
        out = [ret]
    else:  # a tuple/list of results, None (in-place kernels) or a Python scalar (.item())
        out = [x for x in ret if isinstance(x, torch.Tensor)] if isinstance(ret, (list, tuple)) else []
    for i, a in enumerate(op._schema.arguments):
        v = args[i] if i < len(args) else kwargs.get(a.name)
        if a.alias_info is not None and a.alias_info.is_write and isinstance(v, torch.Tensor) \
                and not any(v is o for o in out):
            out.append(v)
    return out


def pick(out, where):
    t = out[where["output"]]
    if where["kind"] == "bt":
        return t[where["b"], where["t"]]
    if where["kind"] == "bht":
        return t[where["b"], :, where["t"]]
    return t[where["row"]]


def deref(v, done):
    # {"ref": [call, output]}: the value an earlier call of the same side produced in this replay
    if isinstance(v, dict) and set(v) == {"ref"}:
        return done[v["ref"][0]][v["ref"][1]]
    if isinstance(v, (list, tuple)):
        return type(v)(deref(x, done) for x in v)
    return v


def value(side, name):
    if "calls" not in side:  # one operator on its recorded inputs
        got = pick(outputs_of(resolve(side["op"]), side["args"], side["kwargs"]), side["where"])
        same(got, side["expect"], name)
        return got
    done = []  # a module: its operator sequence, each call fed by the calls before it
    for c in side["calls"]:
        done.append(outputs_of(resolve(c["op"]), deref(c["args"], done), {k: deref(v, done) for k, v in c["kwargs"].items()}))
    got = pick(done[side["target"]], side["where"])
    same(got, side["recorded"], name)
    return got


def same(got, want, name):
    # the fresh process must compute what the engine computed, bit for bit, or this is not the same kernel
    want = want.to(got.device)
    if got.dtype != want.dtype or got.shape != want.shape or \
            not torch.equal(got.contiguous().reshape(-1).view(torch.uint8), want.contiguous().reshape(-1).view(torch.uint8)):
        raise RuntimeError(f"the replay of side {name} does not give the value it recorded")


def ordered(x):
    # integers whose order and spacing follow the floats: adjacent floats differ by 1
    ints = {torch.float16: (torch.int16, 0x7FFF), torch.bfloat16: (torch.int16, 0x7FFF),
            torch.float32: (torch.int32, 0x7FFFFFFF), torch.float64: (torch.int64, 0x7FFFFFFFFFFFFFFF)}
    if x.dtype not in ints:
        x = x.to(torch.float64)
    int_dtype, magnitude = ints[x.dtype]
    i = x.view(int_dtype).to(torch.int64)
    return torch.where(i < 0, -(i & magnitude), i)


def main():
    data = torch.load(os.path.join(HERE, "repro_tensors.pt"), weights_only=False)
    got_b = value(data["b"], "B")
    got_a = value(data["a"], "A") if data["a"] is not None else data["a_value"]
    if got_a.dtype != got_b.dtype or not got_a.is_floating_point():
        va, vb = got_a.to(torch.float64).flatten(), got_b.to(torch.float64).flatten()
    else:
        va, vb = got_a.flatten(), got_b.flatten()
    va, vb = va.cpu(), vb.cpu()
    if va.shape != vb.shape:
        print(f"DIFFERS in shape: side A {tuple(got_a.shape)} vs side B {tuple(got_b.shape)}")
        return 1
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[va.element_size()]
    differ = (va.view(bits) != vb.view(bits)) if va.is_floating_point() else (va != vb)
    if not bool(differ.any()):
        print(f"identical: _vllm_fa3_C.fwd.default gives the same bits on both sides ({va.numel()} elements)")
        return 0
    i = int(differ.nonzero()[0, 0])
    x, y = va[i:i + 1], vb[i:i + 1]
    if got_a.dtype == got_b.dtype:  # ulps in the dtype the operator produced
        ulps = int((ordered(x) - ordered(y)).abs())
    else:
        ulps = int((ordered(x.to(torch.float64)) - ordered(y.to(torch.float64))).abs())
    print(f"DIFFERS _vllm_fa3_C.fwd.default: {int(differ.sum())} of {va.numel()} elements differ; first at element {i}: "
          f"side A {x.item()!r} vs side B {y.item()!r} ({ulps} ulp)")
    return 1


if __name__ == "__main__":
    try:
        code = main()
    except Exception as e:  # a broken repro must not exit 1, which means "the difference exists"
        print(f"repro error: {type(e).__name__}: {e}")
        code = 3
    sys.exit(code)
