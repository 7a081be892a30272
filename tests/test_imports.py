"""No import cycles in the package: every module imports on its own in a fresh interpreter, and
the import graph read from the source (module-level and function-level imports, absolute and
relative) has no cycle."""
import ast
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "minimind_parallel"


def modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under the package directory `root`."""
    out = {}
    for f in sorted(root.rglob("*.py")):
        parts = f.relative_to(root.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def imported(name: str, path: Path, mods: dict) -> set[str]:
    """The package modules that importing `name` runs: each module it imports anywhere in its
    source, with the packages above that module which are not already above `name`."""
    here = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                base = ".".join(up + ([node.module] if node.module else []))
            # `from P import x`: the submodule P.x when there is one, else a name of P's own code
            targets |= {f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names}
    ran = set()
    for t in targets:
        parts = t.split(".")
        ran |= {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
    ancestors = {".".join(name.split(".")[:i]) for i in range(1, len(name.split(".")) + 1)}
    return {m for m in ran if m in mods and m not in ancestors}


def find_cycles(root: Path) -> list[list[str]]:
    """Every cycle closed by a back edge of a depth-first walk of the import graph."""
    mods = modules(root)
    graph = {m: sorted(imported(m, f, mods)) for m, f in mods.items()}
    cycles, state, stack = [], {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for dep in graph[m]:
            if state.get(dep) == "open":
                cycles.append(stack[stack.index(dep):] + [dep])
            elif dep not in state:
                visit(dep)
        stack.pop()
        state[m] = "done"

    for m in graph:
        if m not in state:
            visit(m)
    return cycles


def test_the_package_has_no_import_cycle():
    cycles = find_cycles(ROOT)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_cycle_check_finds_a_cycle_through_a_function_level_and_a_package_import(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from .sub import b\n")
    (pkg / "sub" / "__init__.py").write_text("from . import c\n")
    (pkg / "sub" / "b.py").write_text("")
    (pkg / "sub" / "c.py").write_text("import pkg.a\n")
    assert find_cycles(pkg) == [["pkg.a", "pkg.sub", "pkg.sub.c", "pkg.a"]]
    (pkg / "sub" / "c.py").write_text("import pkg.sub.b\nfrom . import b\n")  # siblings: no cycle
    assert find_cycles(pkg) == []


def test_every_module_imports_on_its_own():
    """One interpreter; before each module every module of the package is forgotten, so each is
    imported as if first (a cycle shows as a partially initialised module)."""
    names = [m for m in modules(ROOT) if not m.endswith("__main__")]  # __main__ runs the command line
    code = textwrap.dedent(f"""
        import importlib, sys, traceback
        failed = []
        for name in {names!r}:
            for m in [m for m in sys.modules if m == "minimind_parallel" or m.startswith("minimind_parallel.")]:
                del sys.modules[m]
            try:
                importlib.import_module(name)
            except Exception:
                failed.append(name + ": " + traceback.format_exc().strip().splitlines()[-1])
        print("\\n".join(failed))
        sys.exit(1 if failed else 0)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       cwd=ROOT.parent)
    assert r.returncode == 0, r.stdout + r.stderr
    assert len(names) > 30


def test_the_command_line_loads_neither_dtensor_fsdp2_nor_dcp():
    """The command line (and so `plan`) imports no sharding machinery of PyTorch's: DTensor, FSDP2
    and DCP load half a second of sympy and op tables, imported where a save, a load or --zero 3
    needs them (distributed/loaded_types.py checks their classes without importing them)."""
    slow = ("torch.distributed.tensor", "torch.distributed.fsdp", "torch.distributed.checkpoint")
    code = f"import sys, minimind_parallel.cli; print([m for m in {slow!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=ROOT.parent)
    assert out.stdout.strip() == "[]"


def test_the_type_checks_answer_as_isinstance_once_the_class_is_loaded():
    """False before torch.distributed.tensor / fsdp are imported (no instance can exist); then a
    real DTensor (one gloo rank in this process) and an FSDP2 module are seen, plain ones not."""
    code = textwrap.dedent("""
        import torch, torch.distributed as dist
        from minimind_parallel.distributed.loaded_types import is_dtensor, is_fsdp_module
        print(is_dtensor(torch.zeros(1)), is_fsdp_module(torch.nn.Linear(1, 1)))
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import Replicate, distribute_tensor
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
        mesh = DeviceMesh("cpu", [0])
        d = distribute_tensor(torch.zeros(2), mesh, [Replicate()])
        sharded = fully_shard(torch.nn.Linear(2, 2), mesh=mesh)
        print(is_dtensor(d), is_dtensor(d.to_local()), is_fsdp_module(sharded), is_fsdp_module(torch.nn.Linear(1, 1)))
        dist.destroy_process_group()
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT.parent)
    assert out.stdout.split() == ["False", "False", "True", "False", "True", "False"], out.stdout + out.stderr
