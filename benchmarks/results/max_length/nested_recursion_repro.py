"""Deeply nested recompute regions hit Python's recursion limit when the rewritten module runs."""

import dataclasses
import sys

import chkpt_opt
from chkpt_opt import zoo
from chkpt_opt.memory_model.schedule import Schedule

depth = int(sys.argv[1])
model, args, kwargs = zoo.mlp(width=16, depth=depth + 4, batch=4)
plan = chkpt_opt.plan(
    model, args, budget=10**12, optimizer=None, solver="keep_all", profile_times=False
)
g = plan.graph
ops = sorted(g.nodes, key=lambda n: g.nodes[n]["index"])
ok = [i for i, n in enumerate(ops) if g.nodes[n]["cut_after_ok"]]
starts = [i + 1 for i in ok[: depth + 1] if i + 1 < len(ops) - 2]
outer = tuple(ops[starts[0] : -2])
nested = tuple(tuple(ops[s:-2]) for s in starts[1:depth])
sched = Schedule(regions=(outer,), nested=nested)
chkpt_opt.simulate(g, sched)  # a valid schedule
result = dataclasses.replace(plan.result, schedule=sched)
module = dataclasses.replace(plan, result=result, profile=chkpt_opt.simulate(g, sched)).apply()
print(f"nesting depth {len(nested) + 1}: ", end="", flush=True)
try:
    out = module(*args)
    out.sum().backward() if out.dim() == 0 or True else None
    print("ran")
except RecursionError as err:
    print("RecursionError:", err)
