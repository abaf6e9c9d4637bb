"""The shape of the package: no import cycles, small modules, solvers and graph files
without torch."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "chkpt_opt"

MAX_LINES = 450
"""Most lines a module of chkpt_opt may have (aim for about 400)."""

AUTO = "chkpt_opt.solvers.auto"
"""The composer: a package whose modules alone look solvers up."""

MAX_MODULES_PER_FOLDER = 15
"""Most modules (``__init__`` aside) one folder of chkpt_opt may hold directly."""

SOLVER_LAYERS: tuple[frozenset[str], ...] = (
    frozenset({"common"}),  # solvers/ itself: base, deadline, registry, segments
    frozenset({"interval", "heuristics"}),  # the keep-set interval model; keep_all, sqrt, greedy
    frozenset({"engines"}),  # CP-SAT, MILP, LP over the interval program
    frozenset({"bounds", "chain", "blocks"}),  # bounds; dp_chain; the hierarchical block solver
    frozenset({"keepset", "nested"}),  # exact keep-set programs; nested schedules
    frozenset({"cached", "staged"}),  # cached ops (from the keep-set optimum); staged schedules
    frozenset({"auto"}),  # the only composer
)
"""The families of chkpt_opt.solvers, lowest first: a module imports from its own family or
from a family of a lower layer, never from the same layer's other families or above.
A family is a subpackage of solvers/; its top-level modules are ``common`` (``auto`` aside)."""

PACKAGE_LAYERS: tuple[frozenset[str], ...] = (
    frozenset({"fx_attrs"}),  # fetch_attr: the one fx helper the tracer and codegen share
    frozenset({"graphs"}),  # the CostGraph, its files; the tracer (fake tensors only)
    frozenset({"codegen"}),  # the rewritten fx module that runs a schedule
    frozenset({"measurement"}),  # op times, kernel workspace, region costs; a real step
    frozenset(
        {"api", "solved_plan", "attachment", "validation", "export", "bench", "cli"}
    ),  # drivers
)
"""The torch-facing parts of chkpt_opt, lowest first: a part (a top-level module or
subpackage) imports from its own layer or a lower one, never from a higher one. Parts not
named here (memory_model, step_budget, solvers, ...) are pure Python and below them all."""

MAX_ROOT_MODULES = 8
"""Most loose modules (``__init__`` included) at the package root: a concept gets a folder."""

MEMORY_MODEL = "chkpt_opt.memory_model"
"""The memory model: schedules, their files, the op sequence, the simulator."""

MEMORY_MODEL_READS = ("chkpt_opt.memory_model", "chkpt_opt.graphs.", "chkpt_opt.errors")
"""What the memory model may import from chkpt_opt: itself, the cost graph, the errors
(never the tracer, the solvers, codegen or the step's budget, which all read it)."""

MEASURING_MODULES = frozenset(
    f"chkpt_opt.measurement.{name}" for name in ("op_times", "workspace", "region_costs")
)
"""The modules that measure into a cost graph: reached from outside the package only
through its driver (``chkpt_opt.measurement.measure_traced``, ``trace_and_measure``)."""

OVER_MAX_LINES: dict[str, int] = {
    # Modules still over MAX_LINES while they are being split; remove a line once its
    # module is under the limit. The test fails if one of them grows past its count here.
}


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules ``name`` imports anywhere in its file (in-function imports too).

    ``from package import x`` counts as importing ``package.x`` when that is a module, and
    ``package`` otherwise; a package's own ``__init__`` is not counted as importing its
    submodules' parents.
    """
    found: set[str] = set()
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text())):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                full = f"{base}.{alias.name}"
                targets.append(full if full in modules else base)
        for target in targets:
            # The module itself, or the innermost package module holding it.
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph``, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_no_import_cycles() -> None:
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


FRONT_ENDS = {
    "keepset.cpsat",
    "keepset.milp",
    "keepset.lp_round",
    "keepset.pruned",
    "keepset.flat",
    "auto",
    "blocks.hierarchical",
    "registry",
}


def test_solver_layers_point_one_way() -> None:
    """Engines import no front-end and register nothing; only auto looks solvers up."""
    modules = _modules()
    for name, path in modules.items():
        if not name.startswith("chkpt_opt.solvers."):
            continue
        imported = _imports(name, path, modules)
        short = {t.removeprefix("chkpt_opt.solvers.") for t in imported}
        if ".engines." in name:
            assert not short & FRONT_ENDS, (name, short & FRONT_ENDS)
        looks_up = "get_solver(" in path.read_text()
        composer = name == AUTO or name.startswith(AUTO + ".") or name.endswith(".registry")
        assert not looks_up or composer, f"{name} looks solvers up"


def _solver_family(name: str) -> str | None:
    """The family of a module of chkpt_opt.solvers (see SOLVER_LAYERS), None outside it."""
    if name != "chkpt_opt.solvers" and not name.startswith("chkpt_opt.solvers."):
        return None
    parts = name.split(".")[2:]
    if not parts:
        return "common"
    if (PACKAGE / "solvers" / parts[0]).is_dir():
        return parts[0]
    return "auto" if parts[0] == "auto" else "common"


def _package_part(name: str) -> str | None:
    """The part of chkpt_opt (see PACKAGE_LAYERS) a module belongs to, None outside them."""
    parts = name.split(".")
    named = set().union(*PACKAGE_LAYERS)
    return parts[1] if len(parts) > 1 and parts[1] in named else None


def _layer_violations(
    graph: dict[str, set[str]],
    layers: tuple[frozenset[str], ...],
    family_of: Callable[[str], str | None] = _solver_family,
    *,
    same_layer: bool = False,
) -> list[str]:
    """Imports of ``graph`` (module -> imported modules) that go to a higher layer, or to
    another family of the same layer unless ``same_layer`` allows it; ``family_of`` names
    a module's family (None: outside the layers)."""
    layer_of = {family: i for i, families in enumerate(layers) for family in families}
    bad = []
    for name, imported in sorted(graph.items()):
        family = family_of(name)
        if family is None:
            continue
        for target in sorted(imported):
            other = family_of(target)
            if other is None or other == family:
                continue
            if layer_of[other] > layer_of[family] or (
                layer_of[other] == layer_of[family] and not same_layer
            ):
                bad.append(f"{name} ({family}) imports {target} ({other})")
    return bad


def test_solver_families_are_layered() -> None:
    modules = _modules()
    folders = {p.name for p in (PACKAGE / "solvers").iterdir() if (p / "__init__.py").exists()}
    named = set().union(*SOLVER_LAYERS)
    assert folders | {"common", "auto"} == named, "place every solvers/ subpackage in SOLVER_LAYERS"
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    bad = _layer_violations(graph, SOLVER_LAYERS)
    assert not bad, "imports against the order of SOLVER_LAYERS:\n" + "\n".join(bad)


def test_layer_check_sees_an_import_from_above() -> None:
    graph = {
        "chkpt_opt.solvers.interval.model": {"chkpt_opt.solvers.keepset.flat"},
        "chkpt_opt.solvers.keepset.flat": {"chkpt_opt.solvers.interval.model"},
        "chkpt_opt.solvers.blocks.search": {"chkpt_opt.solvers.chain.cuts"},
        "chkpt_opt.solvers.base": {"chkpt_opt.solvers.auto"},
    }
    assert _layer_violations(graph, SOLVER_LAYERS) == [
        "chkpt_opt.solvers.base (common) imports chkpt_opt.solvers.auto (auto)",
        "chkpt_opt.solvers.blocks.search (blocks) imports chkpt_opt.solvers.chain.cuts (chain)",
        "chkpt_opt.solvers.interval.model (interval) imports chkpt_opt.solvers.keepset.flat "
        "(keepset)",
    ]


def test_torch_facing_parts_are_layered() -> None:
    """graphs/ never imports codegen, codegen never measures, measurement drives no api."""
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    bad = _layer_violations(graph, PACKAGE_LAYERS, _package_part, same_layer=True)
    assert not bad, "imports against the order of PACKAGE_LAYERS:\n" + "\n".join(bad)


def test_package_layer_check_sees_the_tracer_importing_codegen() -> None:
    graph = {
        "chkpt_opt.graphs.tracer.build": {"chkpt_opt.codegen.rewrite", "chkpt_opt.fx_attrs"},
        "chkpt_opt.api": {"chkpt_opt.attachment", "chkpt_opt.measurement"},
    }
    assert _layer_violations(graph, PACKAGE_LAYERS, _package_part, same_layer=True) == [
        "chkpt_opt.graphs.tracer.build (graphs) imports chkpt_opt.codegen.rewrite (codegen)"
    ]


def test_measurements_are_written_only_through_the_driver() -> None:
    """Outside chkpt_opt.measurement no module imports a measuring module: trace, plan and
    the attachment reach op times, kernel workspace and region costs through one path."""
    modules = _modules()
    assert set(modules) >= MEASURING_MODULES
    for name, path in modules.items():
        if name.startswith("chkpt_opt.measurement"):
            continue
        reached = _imports(name, path, modules) & MEASURING_MODULES
        assert not reached, (
            f"{name} imports {sorted(reached)}; call chkpt_opt.measurement.measure_traced "
            "(or trace_and_measure) instead"
        )


def test_the_package_root_holds_few_loose_modules() -> None:
    loose = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(loose) <= MAX_ROOT_MODULES, (
        f"{len(loose)} loose modules at chkpt_opt/: {loose}; give a concept a package"
    )


def test_the_memory_model_reads_only_the_cost_graph() -> None:
    modules = _modules()
    inside = {name: path for name, path in modules.items() if name.startswith(MEMORY_MODEL)}
    assert f"{MEMORY_MODEL}.op_sequence" in inside and f"{MEMORY_MODEL}.simulate" in inside
    for name, path in inside.items():
        outside = sorted(
            target
            for target in _imports(name, path, modules)
            if not target.startswith(MEMORY_MODEL_READS) or "tracer" in target
        )
        assert not outside, f"{name} imports {outside}: the memory model reads only the graph"


def test_folders_are_small() -> None:
    counts: dict[str, int] = {}
    for path in PACKAGE.rglob("*.py"):
        if path.name != "__init__.py":
            folder = str(path.parent.relative_to(PACKAGE.parent))
            counts[folder] = counts.get(folder, 0) + 1
    crowded = {folder: n for folder, n in counts.items() if n > MAX_MODULES_PER_FOLDER}
    assert not crowded, (
        f"folders with more than {MAX_MODULES_PER_FOLDER} modules: {crowded}; group them "
        "into subpackages"
    )


def _registering(modules: dict[str, Path]) -> set[str]:
    """The modules that register a solver (``@register(...)`` on a class)."""
    return {
        name
        for name, path in modules.items()
        if re.search(r"^@register\(", path.read_text(), re.MULTILINE)
    }


def test_only_auto_composes_solvers() -> None:
    """No module but auto imports a registered solver's module: a registered solver never
    runs another one (as a fallback or an incumbent); shared heuristics and searches live in
    unregistered modules (``heuristics.greedy_sweep``, ``blocks.search``,
    ``keepset.pruned_search``)."""
    modules = _modules()
    registering = _registering(modules)
    assert {
        "chkpt_opt.solvers.heuristics.greedy",
        "chkpt_opt.solvers.keepset.pruned",
    } <= registering
    for name, path in modules.items():
        if name == AUTO or name.startswith(AUTO + "."):
            continue
        composed = _imports(name, path, modules) & registering
        assert not composed, (
            f"{name} imports the registered solver modules {sorted(composed)}; move what it "
            "needs into an unregistered module, and leave choosing among solvers to auto"
        )


def test_cycle_finder_sees_lazy_imports(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.b import f\n")
    (pkg / "b.py").write_text("def f():\n    from pkg import a\n    return a\n")
    modules = {"pkg": pkg / "__init__.py", "pkg.a": pkg / "a.py", "pkg.b": pkg / "b.py"}
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert _cycle(graph) == ["pkg.a", "pkg.b", "pkg.a"]


def test_modules_are_small() -> None:
    sizes = {
        str(path.relative_to(PACKAGE.parent)): len(path.read_text().splitlines())
        for path in _modules().values()
    }
    too_long = {
        name: lines for name, lines in sizes.items() if lines > OVER_MAX_LINES.get(name, MAX_LINES)
    }
    assert not too_long, (
        f"modules over {MAX_LINES} lines (or over their count in OVER_MAX_LINES): {too_long}; "
        "split them by responsibility"
    )
    shrunk = {name: sizes.get(name) for name in OVER_MAX_LINES if sizes.get(name, 0) <= MAX_LINES}
    assert not shrunk, f"{shrunk} are at most {MAX_LINES} lines now: drop them from OVER_MAX_LINES"


TORCH_FREE = """
import sys
import chkpt_opt.solvers
from chkpt_opt.graphs.io import load_graph, save_graph
from chkpt_opt.graphs.synthetic import chain_graph
from chkpt_opt.solvers import available_solvers, get_solver
import chkpt_opt.memory_model.replay_cost, chkpt_opt.memory_model.schedule_io
import chkpt_opt.step_budget.fsdp2_timeline, chkpt_opt.step_budget.sharding
from chkpt_opt.memory_model.simulate import simulate
from chkpt_opt.memory_model.schedule import Schedule

path = sys.argv[1]
save_graph(chain_graph(6), path)
graph = load_graph(path)
names = available_solvers()
for name in ("greedy", "dp_chain", "cpsat"):
    assert name in names, name
    assert get_solver(name)(graph, 10**12).feasible, name
assert simulate(graph, Schedule()).peak_bytes > 0
assert "torch" not in sys.modules, sorted(m for m in sys.modules if m.startswith("torch"))
print("ok")
"""


def test_solvers_memory_model_and_graph_files_do_not_import_torch(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", TORCH_FREE, str(tmp_path / "g.json")],
        capture_output=True,
        text=True,
        cwd=PACKAGE.parent,
        env={"PYTHONPATH": str(PACKAGE.parent), "PATH": ""},
        timeout=120,
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


@pytest.mark.parametrize("name", ["plan", "validate", "ValidationReport", "optimize"])
def test_names_that_need_torch_are_still_exported(name: str) -> None:
    import chkpt_opt

    value = getattr(chkpt_opt, name)
    assert callable(value) and not isinstance(value, type(chkpt_opt)), name


def test_no_lazy_name_is_also_a_submodule_name() -> None:
    # Importing chkpt_opt.<name> binds the submodule on the package over a lazy function of
    # that name (the checks once lived in chkpt_opt.validate and hid chkpt_opt.validate()).
    import chkpt_opt

    package = Path(chkpt_opt.__file__).parent
    for name in chkpt_opt._LAZY:
        assert not (package / f"{name}.py").exists() and not (package / name).is_dir(), name


def test_builtin_solvers_are_keyed_by_the_name_they_register() -> None:
    from chkpt_opt.solvers import registry

    registry.available_solvers()
    for name, module in registry._BUILTIN.items():
        assert registry._REGISTRY[name].__module__ == module, (name, module)


def test_a_solver_without_ortools_is_reported_by_its_solver_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The module that registers "cached" is not named "cached": the refusal must still
    # name OR-Tools, not call the solver unknown.
    import importlib
    import types

    from chkpt_opt.errors import SolverError
    from chkpt_opt.solvers import registry

    registry.available_solvers()
    blocked = registry._BUILTIN["cached"]

    def import_module(name: str) -> types.ModuleType:
        if name == blocked:
            raise ImportError("No module named 'ortools'")
        return importlib.import_module(name)

    registry_without = {k: v for k, v in registry._REGISTRY.items() if k != "cached"}
    monkeypatch.setattr(registry, "_REGISTRY", registry_without)
    monkeypatch.setattr(registry, "_UNAVAILABLE", {})
    monkeypatch.setattr(registry, "importlib", types.SimpleNamespace(import_module=import_module))
    with pytest.raises(SolverError, match="needs OR-Tools"):
        registry.get_solver("cached")
    assert registry.get_solver("greedy").name == "greedy"


EVERY_SOLVER_MODULE = """
import importlib
import pkgutil
import sys

import chkpt_opt.solvers

for info in pkgutil.walk_packages(chkpt_opt.solvers.__path__, "chkpt_opt.solvers."):
    importlib.import_module(info.name)
assert "torch" not in sys.modules, sorted(m for m in sys.modules if m.startswith("torch"))
print("ok")
"""


def test_every_solver_module_imports_without_torch() -> None:
    done = subprocess.run(
        [sys.executable, "-c", EVERY_SOLVER_MODULE],
        capture_output=True,
        text=True,
        cwd=PACKAGE.parent,
        env={"PYTHONPATH": str(PACKAGE.parent), "PATH": ""},
        timeout=120,
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
