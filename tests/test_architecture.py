"""The package's layering (docs/architecture.md): imports only go down, and nothing forms a cycle.

Every import counts, inside functions too, except those under ``if TYPE_CHECKING:``.
Registries that import on demand name their targets as ``"module:Name"`` strings, and
``import_module("mmrl....")`` takes a literal; both count as imports here.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import mmrl

ROOT = Path(mmrl.__file__).parent
# Bottom to top; a module may import from its own layer or a lower one.
LAYERS = {
    "protocol": 1,
    "utils": 1,
    "config": 1,
    "sampling": 1,
    "errors": 1,
    "algos": 2,
    "models": 3,
    "processors": 4,
    "verifiers": 4,
    "worldmodel": 4,
    "data": 4,
    "rollout": 5,
    "hybrid": 6,
    "tasks": 7,
    "trainer": 8,
}
LAZY_TARGET = re.compile(r"^(mmrl(?:\.\w+)+):\w+$")
MAX_MODULE_LINES = 400


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def resolve(name: str) -> str:
    """The module an imported dotted name refers to (``mmrl.a.b.Name`` -> ``mmrl.a.b``)."""
    while name not in MODULES and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def _type_checking_block(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")
    )


def imports_of(module: str) -> set[str]:
    """The mmrl modules ``module`` imports, at any depth of its code."""
    tree = ast.parse(MODULES[module].read_text())
    package = module if MODULES[module].name == "__init__.py" else module.rsplit(".", 1)[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if _type_checking_block(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("mmrl"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            if base.startswith("mmrl"):
                # `from mmrl.pkg import submodule` imports that submodule.
                found.update(
                    f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base
                    for a in node.names
                )
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            match = LAZY_TARGET.match(node.value)
            if match:
                found.add(match.group(1))
        elif isinstance(node, ast.Call) and getattr(
            node.func, "id", getattr(node.func, "attr", "")
        ) == ("import_module"):
            arg = node.args[0] if node.args else None
            if isinstance(arg, ast.Constant) and str(arg.value).startswith("mmrl"):
                found.add(arg.value)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return {resolve(name) for name in found} - {module}


GRAPH = {module: imports_of(module) for module in MODULES}


def layer_of(module: str) -> tuple[str, int]:
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else "mmrl"
    return top, LAYERS.get(top, 0)


def test_every_folder_has_a_layer():
    tops = {layer_of(m)[0] for m in MODULES} - {"mmrl"}
    assert not tops - set(LAYERS), (
        f"folders without a layer in LAYERS: {sorted(tops - set(LAYERS))}"
    )


def test_imports_never_go_up_a_layer():
    upward = []
    for module, targets in GRAPH.items():
        top, layer = layer_of(module)
        for target in sorted(targets):
            target_top, target_layer = layer_of(target)
            if target_layer > layer:
                upward.append(f"{module} (layer {layer}) -> {target} (layer {target_layer})")
    assert not upward, "imports that go up a layer:\n" + "\n".join(upward)


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a list of nodes, or None."""
    state: dict[str, int] = defaultdict(int)  # 0 unseen, 1 on the stack, 2 done
    stack: list[str] = []

    def walk(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state[nxt] == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if state[nxt] == 0:
                found = walk(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if state[node] == 0:
            found = walk(node)
            if found:
                return found
    return None


# The PPO machinery (the loss and advantage code, the workers, the engines' dispatch, the fit
# loop) reaches a policy family only through the PolicyFamily interface: none of it imports
# a family's own modules or names a family's internals (denoising steps, noise levels).
FAMILY_MODULES = re.compile(r"^mmrl\.models\.(flow_|latent_|text_lm|vlm)")
FAMILY_WORDS = re.compile(r"denois|\bsde\b|noise_level|num_steps|flow_path|flow_mean|flow_std")
CORE = ("algos", "hybrid", "rollout", "trainer")


def test_the_ppo_core_knows_policy_families_only_by_their_interface():
    leaks = []
    for module, targets in GRAPH.items():
        if layer_of(module)[0] not in CORE:
            continue
        leaks += [f"{module} imports {t}" for t in sorted(targets) if FAMILY_MODULES.match(t)]
        for number, line in enumerate(MODULES[module].read_text().splitlines(), 1):
            if word := FAMILY_WORDS.search(line):
                leaks.append(f"{module}:{number} names {word.group()}")
    assert not leaks, "policy-family internals in the PPO core:\n" + "\n".join(leaks)


def test_no_import_cycle_between_modules():
    cycle = _cycle(GRAPH)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_no_import_cycle_between_folders():
    folders: dict[str, set[str]] = defaultdict(set)
    for module, targets in GRAPH.items():
        for target in targets:
            if layer_of(target)[0] != layer_of(module)[0]:
                folders[layer_of(module)[0]].add(layer_of(target)[0])
    cycle = _cycle(folders)
    assert cycle is None, "folders that import each other: " + " -> ".join(cycle or [])


def test_the_checker_sees_function_level_and_lazy_imports(tmp_path):
    source = (
        "def f():\n    from mmrl.trainer import fit\n"
        "X = 'mmrl.rollout.vllm:VLLMRollout'\n"
        "if TYPE_CHECKING:\n    from mmrl.tasks import Task\n"
    )
    path = ROOT / "utils" / "_probe_for_test.py"
    try:
        path.write_text(source)
        MODULES["mmrl.utils._probe_for_test"] = path
        assert imports_of("mmrl.utils._probe_for_test") == {"mmrl.trainer.fit", "mmrl.rollout.vllm"}
    finally:
        MODULES.pop("mmrl.utils._probe_for_test", None)
        path.unlink(missing_ok=True)


def test_modules_stay_small():
    big = {
        m: n
        for m, p in MODULES.items()
        if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not big, f"modules over {MAX_MODULE_LINES} lines: {big}"


def _lazy_targets() -> dict[str, str]:
    """Every ``"mmrl.module:Name"`` string in the package, with the module that names it."""
    found = {}
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            text = node.value if isinstance(node, ast.Constant) else None
            if isinstance(text, str) and LAZY_TARGET.match(text):
                found[text] = module
    return found


def _top_level_names(module: str) -> set[str]:
    names = set()
    for node in ast.parse(MODULES[module].read_text()).body:
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def test_lazy_registry_entries_name_what_exists():
    # Checked without importing: a lazy entry exists to keep a costly import (vLLM) away.
    targets = _lazy_targets()
    assert "mmrl.rollout.vllm:VLLMRollout" in targets
    broken = [
        f"{target} (named in {owner})"
        for target, owner in sorted(targets.items())
        if (mod := target.split(":")[0]) not in MODULES
        or target.split(":")[1] not in _top_level_names(mod)
    ]
    assert not broken, f"lazy registry entries that name nothing: {broken}"


def test_every_registry_is_one_registry_type():
    from mmrl import algos, models, rollout, tasks, verifiers
    from mmrl.utils.registry import Registry
    from mmrl.verifiers.closed_loop import TASK_SCORES
    from mmrl.worldmodel.envs import ENVS

    for registry in (
        algos.ADV_ESTIMATORS,
        algos.POLICY_LOSSES,
        algos.KL_PENALTIES,
        algos.KL_CONTROLLERS,
        rollout.ROLLOUT_ENGINES,
        verifiers.VERIFIERS,
        TASK_SCORES,
        ENVS,
        tasks.TASKS,
        models.FAMILIES,
    ):
        assert isinstance(registry, Registry), registry
    # No module keeps a hand-written registry dict beside them.
    hand_written = [
        f"{module}: {line.strip()}"
        for module, path in MODULES.items()
        for line in path.read_text().splitlines()
        if re.match(r"^[A-Z_]+: dict\[str, (Callable|type)", line)
    ]
    assert not hand_written, hand_written
