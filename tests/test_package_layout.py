"""The package's shape (issue 22): the root holds only entry points and folders, every folder says in its
`__init__` what lives there, imports between folders point down the tiers docs/architecture.md's "Code layout" fixes, and no
module imports itself back through others. Read from the source with `ast` (lazy and type-only imports count:
they are dependencies too), so nothing here imports rlrun."""

from __future__ import annotations

import ast
from pathlib import Path

from helpers import REPO

PACKAGE = REPO / "src" / "rlrun"

# What users start: `python -m rlrun.X`.
ENTRY_MODULES = {"rlrun.ppo", "rlrun.sft", "rlrun.rm", "rlrun.dpo", "rlrun.retriever_server", "rlrun.reward_server",
                 "rlrun.report"}

# Bottom to top; a folder imports only folders of LOWER tiers (docs/architecture.md, "Code layout", says the same).
TIERS: list[set[str]] = [
    {"runtime", "algo"},
    {"config"},
    {"models", "serving"},
    {"data", "compat"},
    {"cli", "launch", "vision", "rewards"},
    {"reporting", "checkpoint"},
    {"strategies", "engines"},
    {"roles", "agents", "weight_sync", "gateway"},
    {"plan", "environments"},
    {"run"},
    {"rl", "supervised", "tinker"},
]
TIER = {folder: level for level, folders in enumerate(TIERS) for folder in folders}


def _modules() -> dict[str, Path]:
    mods = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        mods[name] = path
    return mods


def _imports(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """Every rlrun module `name` imports, wherever the import statement sits."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in mods else base for alias in node.names]
        for target in targets:
            while target not in mods and "." in target:
                target = target.rsplit(".", 1)[0]
            if target in mods and target.startswith("rlrun.") and target != name:
                found.add(target)
    return found


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {name: _imports(name, path, mods) for name, path in mods.items()}


def _folder(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (PACKAGE / parts[-1]).is_dir() else None


def test_root_holds_only_entry_points_and_folders():
    loose = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__"}
    assert loose == {m.split(".")[1] for m in ENTRY_MODULES if m.count(".") == 1}
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == set(TIER), "a new folder needs its tier in TIERS and in docs/architecture.md's Code layout"


def test_every_folder_says_what_lives_there():
    for folder in sorted(TIER):
        init = PACKAGE / folder / "__init__.py"
        doc = ast.get_docstring(ast.parse(init.read_text())) if init.exists() else None
        assert doc and len(doc.split()) >= 12, f"{init}: a docstring saying what lives here and what it may import"


def test_imports_point_down_the_tiers():
    upward = []
    for module, targets in _graph().items():
        source = _folder(module)
        if module in ENTRY_MODULES or source is None:
            continue
        for target in targets:
            dest = _folder(target)
            if target in ENTRY_MODULES or dest is None:
                upward.append(f"{module} -> {target} (an entry point)")
            elif dest != source and TIER[dest] >= TIER[source]:
                upward.append(f"{module} -> {target} ({source}/ is tier {TIER[source]}, {dest}/ tier {TIER[dest]})")
    assert not upward, "imports against the tiers:\n" + "\n".join(sorted(upward))


def test_no_import_circles():
    graph = _graph()
    state: dict[str, int] = {}
    circles = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph[module]):
            # A package's __init__ and its own modules may name each other (re-exports), not a circle of code.
            if state.get(target) == 1 and not (module.startswith(target + ".") or target.startswith(module + ".")):
                circles.append(" -> ".join(path[path.index(target):] + [target]))
            elif target not in state:
                visit(target, path)
        path.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [])
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_the_checker_sees_circles_and_upward_imports(tmp_path):
    """The walk above must be able to fail: a planted upward import is caught by the same functions."""
    mods = {"rlrun.algo.a": tmp_path / "a.py", "rlrun.rl.b": tmp_path / "b.py"}
    mods["rlrun.algo.a"].write_text("def f():\n    from rlrun.rl.b import g  # lazy, still a dependency\n")
    mods["rlrun.rl.b"].write_text("from rlrun.algo import a\n")
    assert _imports("rlrun.algo.a", mods["rlrun.algo.a"], mods) == {"rlrun.rl.b"}
    assert _imports("rlrun.rl.b", mods["rlrun.rl.b"], mods) == {"rlrun.algo.a"}
    assert TIER["rl"] > TIER["algo"]


# The whole config tree is for the layers that assemble a run from it: the entry points, the run skeleton, each
# trainer's assembly, planning, the command line and the peers' spellings. Every other component takes its own
# section (issue 45: 20 modules took it before).
WHOLE_CONFIG = {"Config", "RootConfig", "SupervisedConfig", "SFTConfig", "RMConfig", "DPOConfig"}
MAY_TAKE_THE_WHOLE_CONFIG = {"plan", "cli", "compat", "run"}
ASSEMBLY = {"rlrun.rl.assembly", "rlrun.supervised.assembly", "rlrun.supervised.trainers"}


def _takers_of_the_whole_config(source: str) -> list[str]:
    """Functions of `source` with a parameter annotated by one of the root config types."""
    takers = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for arg in node.args.posonlyargs + node.args.args + node.args.kwonlyargs:
                parts = list(ast.walk(arg.annotation)) if arg.annotation is not None else []
                names = {n.id for n in parts if isinstance(n, ast.Name)}
                names |= {n.value for n in parts if isinstance(n, ast.Constant) and isinstance(n.value, str)}
                if names & WHOLE_CONFIG:
                    takers.append(node.name)
    return takers


def test_only_the_assembling_layers_take_the_whole_config():
    takers = {}
    for module, path in _modules().items():
        if module in ENTRY_MODULES or module in ASSEMBLY or _folder(module) in MAY_TAKE_THE_WHOLE_CONFIG:
            continue
        if found := _takers_of_the_whole_config(path.read_text()):
            takers[module] = found
    assert not takers, f"these take the whole config; give them their section instead: {takers}"


def test_the_config_check_sees_a_whole_config_parameter():
    assert _takers_of_the_whole_config("def f(cfg: 'Config', n: int) -> None: ...\ndef g(t: TrainConfig): ...") == ["f"]


def test_modules_are_ideas_not_fragments():
    """Files by concept, not by a line budget (issue 45): half of the modules 150 lines or more, and no more of them
    than concepts to hold (180: issue 61 gave each config section its owner's module; 190: issue 62, the token gateway
    and the environment sources; 191: its TRL environment classes; 192: issue 63, the many senders' delta encoding; 204: issue
    65, rlrun.tinker: its API front, wire formats, calls, request loop, policy, sampler, losses, plan, assembly, entry and
    config section; 205: its HTTP transport apart from the front; 206: vLLM's LoRA adapters by name, engines/vllm/lora.py)."""
    sizes = sorted(len(path.read_text().splitlines()) for path in _modules().values())
    assert len(sizes) <= 206, len(sizes)
    assert sizes[(len(sizes) - 1) // 2] >= 150, sizes


# A generation backend is a module or folder of engines/ reached from outside only through engines/build.py (and the
# surface every backend shares: engines/protocol.py, and engines/receivers.py, how an engine takes a weight sync): a
# new backend touches its folder and one branch of build.py.
ENGINE_SURFACE = {"rlrun.engines", "rlrun.engines.build", "rlrun.engines.protocol", "rlrun.engines.receivers"}


def test_backends_are_reached_only_through_build():
    reached = sorted(f"{module} -> {target}" for module, targets in _graph().items()
                     if not module.startswith("rlrun.engines") for target in targets
                     if target.startswith("rlrun.engines.") and target not in ENGINE_SURFACE)
    assert not reached, "import the backend through rlrun.engines.build:\n" + "\n".join(reached)


def test_strategies_do_not_import_weight_sync():
    """The strategies' full-parameter view (blocks) is theirs; weight sync reads it, not the other way round."""
    back = sorted(f"{m} -> {t}" for m, ts in _graph().items() if m.startswith("rlrun.strategies")
                  for t in ts if t.startswith("rlrun.weight_sync"))
    assert not back, back


def _too_many_parameters(source: str, most: int = 8) -> list[str]:
    """Constructors (__init__) and builders (module-level build_*/make_*) taking more than `most` parameters."""
    found = []
    for node in ast.walk(ast.parse(source)):
        bodies = node.body if isinstance(node, (ast.ClassDef, ast.Module)) else []
        for f in bodies:
            if not isinstance(f, ast.FunctionDef):
                continue
            method = isinstance(node, ast.ClassDef)
            if (method and f.name == "__init__") or (not method and f.name.startswith(("build", "make"))):
                count = len(f.args.posonlyargs) + len(f.args.args) + len(f.args.kwonlyargs) - method
                if count > most:
                    found.append(f"{f.name} ({count})" if not method else f"{node.name}.__init__ ({count})")
    return found


def test_components_take_few_parameters():
    """A component is built from the rank's context and its own settings (issue 61: InProcessEngine took 18, VLLMEngine
    16, RolloutSource and Checkpointer 14): no constructor or builder takes more than 8 parameters. Value records
    (frozen dataclasses of settings) are not components and are not counted."""
    wide = {module: found for module, path in _modules().items() if (found := _too_many_parameters(path.read_text()))}
    assert not wide, wide


def test_the_parameter_count_sees_a_wide_constructor():
    code = "class A:\n    def __init__(self, a, b, c, d, e, f, g, h, *, i): ...\ndef build_x(a, b): ...\n"
    assert _too_many_parameters(code) == ["A.__init__ (9)"]
