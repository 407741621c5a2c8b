"""The README's Layout section is the map of the tree: every package folder is on it, under its import name,
and every folder on it exists."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
IMPORT_ROOTS = {"cli": "packfeed.cli", "loader_server": "packfeed.server", "client": "packfeed.client",
                "trainer": "packfeed.trainer", "media": "packfeed.media", "protos/packfeed/v1": "packfeed.v1"}


def layout_rows() -> dict[str, str]:
    """folder -> import name ('' where none) from the README's Layout table."""
    section = REPO.joinpath("README.md").read_text().split("## Layout", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([^`]+)/` \| (?:`([^`]+)`)? \|", section, flags=re.M)
    assert rows, "no Layout table in README.md"
    return dict(rows)


def import_name(folder: str) -> str:
    for root, name in IMPORT_ROOTS.items():
        if folder == root or folder.startswith(root + "/"):
            return name + folder[len(root):].replace("/", ".")
    return ""


def test_every_package_is_on_the_map_under_its_import_name():
    rows = layout_rows()
    packages = {str(init.parent.relative_to(REPO)) for root in IMPORT_ROOTS if (REPO / root).is_dir()
                for init in (REPO / root).rglob("__init__.py")} | {"protos/packfeed/v1"}
    assert packages - set(rows) == set(), "packages missing from README's Layout"
    for folder, name in rows.items():
        assert (REPO / folder).is_dir(), f"README's Layout lists {folder}/, which does not exist"
        assert name == import_name(folder), folder


def test_every_package_is_installed():
    """pyproject's package list names every package: a wheel (the Docker image) would leave out one it missed."""
    import tomllib

    listed = set(tomllib.loads(REPO.joinpath("pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    packages = {import_name(str(init.parent.relative_to(REPO))) for root in IMPORT_ROOTS if (REPO / root).is_dir()
                for init in (REPO / root).rglob("__init__.py")} | {"packfeed.v1"}
    assert packages - listed == set()


def test_integrations_stay_optional_extras():
    """`pip install packfeed` installs no training framework and no browser: they come with the extras."""
    import tomllib

    project = tomllib.loads(REPO.joinpath("pyproject.toml").read_text())["project"]
    required = {re.split(r"[<>=\[ ;]", spec, maxsplit=1)[0].lower() for spec in project["dependencies"]}
    assert required & {"torch", "transformers", "accelerate", "trl", "lightning", "playwright", "selenium"} == set()
    extras = project["optional-dependencies"]
    assert any(spec.startswith("accelerate") for spec in extras["hf-trainer"])
    assert any(spec.startswith("trl") for spec in extras["trl"])
    assert any(spec.startswith("lightning") for spec in extras["lightning"])


# -- the rules the layout keeps -----------------------------------------------------------------------------------

MAX_MODULE_LINES = 400
# The loader's stages in the order data flows through them: a stage may import the ones before it, never after.
# `cluster` (many servers, one job) serves the serving stage; `tools` and `cli` stand beside or above the flow.
SERVER_FLOW = ["convert", "index", "plan", "live", "cluster", "serve", "tools", "cli"]


def project_modules() -> list[Path]:
    """Every hand-written module of the package (not the generated *_pb2*.py)."""
    return sorted(path for root in IMPORT_ROOTS for path in (REPO / root).rglob("*.py")
                  if "_pb2" not in path.name and "__pycache__" not in path.parts)


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at its top or inside functions (`from a.b import c` counts a.b and a.b.c)."""
    import ast

    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def module_of(path: Path) -> str:
    folder = str(path.parent.relative_to(REPO))
    return import_name(folder) + ("" if path.stem == "__init__" else "." + path.stem)


NEAR_LIMIT = 20  # a module this close to the limit is squeezed, not split
NEAR_LIMIT_REASON = "Near the line limit:"  # ... unless it says why, in a comment that starts so


def test_no_module_is_over_400_lines():
    long = {str(path.relative_to(REPO)): n for path in project_modules()
            if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}, f"split these along their seams (at most {MAX_MODULE_LINES} lines a module)"


def test_no_module_is_squeezed_under_the_limit():
    """A module within NEAR_LIMIT lines of the limit is one that was trimmed to fit: split it along a seam, or
    write why it is one concern (`# Near the line limit: ...`)."""
    near = {str(path.relative_to(REPO)): n for path in project_modules()
            if (n := len((text := path.read_text()).splitlines())) > MAX_MODULE_LINES - NEAR_LIMIT
            and NEAR_LIMIT_REASON not in text}
    assert near == {}, f"split these along a seam, or say why not ({NEAR_LIMIT_REASON} ...)"


def test_no_import_runs_back_up_the_flow():
    backwards = []
    for path in project_modules():
        module = module_of(path)
        if not module.startswith("packfeed.server."):
            continue
        stage = module.split(".")[2]
        if stage not in SERVER_FLOW:
            continue
        for name in imported_modules(path):
            parts = name.split(".")
            if name.startswith("packfeed.server.") and parts[2] in SERVER_FLOW \
                    and SERVER_FLOW.index(parts[2]) > SERVER_FLOW.index(stage):
                backwards.append(f"{path.relative_to(REPO)} imports {name}")
    assert backwards == []


def test_the_client_the_trainer_and_the_media_room_import_no_server_code():
    crossing = []
    for path in project_modules():
        relative, module = str(path.relative_to(REPO)), module_of(path)
        imported = imported_modules(path)
        if module.startswith(("packfeed.client", "packfeed.media", "packfeed.v1")):
            crossing += [f"{relative} imports {name}" for name in imported
                         if name.startswith(("packfeed.server", "packfeed.trainer"))]
        if module.startswith("packfeed.media"):  # what a sample is depends on the contract alone
            crossing += [f"{relative} imports {name}" for name in imported
                         if name.startswith("packfeed.") and not name.startswith(("packfeed.media", "packfeed.v1"))]
        if module.startswith("packfeed.trainer"):
            crossing += [f"{relative} imports {name}" for name in imported if name.startswith("packfeed.server")]
    assert crossing == []


def top_level_imports(path: Path) -> set[str]:
    """The modules a file imports when it is imported (not inside its functions)."""
    import ast

    tree = ast.parse(path.read_text(), str(path))
    return {name for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))
            for name in ([alias.name for alias in node.names] if isinstance(node, ast.Import) else [node.module or ""])}


def test_the_contract_folder_is_pure_python():
    """The contract (`packfeed.v1`) is what a client in any language reads: messages, the plan specification, the
    Redis key layout; no numerics. Importing it needs no redis-py: the one connection both sides make
    (`v1.redis_url.redis_client`) imports it when it connects."""
    contract = [path for path in project_modules() if module_of(path).startswith("packfeed.v1")]
    heavy = [f"{path.relative_to(REPO)} imports {name}" for path in contract for name in imported_modules(path)
             if name.split(".")[0] in ("numpy", "numba", "torch", "PIL", "cv2", "pyarrow")]
    heavy += [f"{path.relative_to(REPO)} imports {name} at its top" for path in contract
              for name in top_level_imports(path) if name.split(".")[0] == "redis"]
    lazily = [path.name for path in contract if "redis" in {n.split(".")[0] for n in imported_modules(path)}]
    assert heavy == [] and lazily == ["redis_url.py"]


def test_the_server_imports_no_client_code_and_nothing_imports_the_command_line():
    """The server and the client stand on the contract; the command line (`packfeed.cli`), which runs both
    (`packfeed demo` streams and trains), is the top of the house: it may import every room, and no room imports
    it (a subprocess that runs `python -m packfeed.cli` is not an import)."""
    imports = {module_of(path): imported_modules(path) for path in project_modules()}
    crossing = [f"{module} imports {name}" for module, names in imports.items() if module.startswith("packfeed.server.")
                for name in names if name.startswith("packfeed.client")]
    assert crossing == []
    upward = [f"{module} imports {name}" for module, names in imports.items() if not module.startswith("packfeed.cli")
              for name in names if name == "packfeed.cli" or name.startswith("packfeed.cli.")]
    assert upward == []
    command_line = [name for module, names in imports.items() if module.startswith("packfeed.cli.") for name in names]
    assert any(name.startswith("packfeed.client") for name in command_line)  # allowed there: the rule sees them
    assert any(name.startswith("packfeed.server") for name in command_line)


def test_the_rules_see_what_they_check():
    """The checks above walk real modules and real imports (a rule over an empty list passes by itself)."""
    modules = {module_of(path) for path in project_modules()}
    assert {"packfeed.server.serve.workers", "packfeed.media.fast", "packfeed.client.stream.pack_stream",
            "packfeed.v1.options",
            "packfeed.trainer.train"} <= modules
    assert "packfeed.server.index.table" in imported_modules(REPO / "loader_server/plan/costs.py")
    assert "numpy" in imported_modules(REPO / "media/resample.py")


def import_graph() -> dict[str, set[str]]:
    """Every project module -> the project modules it imports (at its top, inside functions, or for typing)."""
    modules = {module_of(path): path for path in project_modules()}
    return {module: {name for name in imported_modules(path) if name in modules and name != module}
            for module, path in modules.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that import each other, directly or round about (strongly connected, 2 or more)."""
    order, low, stack, found, counter = {}, {}, [], [], [0]

    def visit(module: str) -> None:  # Tarjan's algorithm
        order[module] = low[module] = counter[0]
        counter[0] += 1
        stack.append(module)
        for other in graph.get(module, ()):
            if other not in order:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], order[other])
        if low[module] == order[module]:
            group = []
            while not group or group[-1] != module:
                group.append(stack.pop())
            if len(group) > 1:
                found.append(sorted(group))

    for module in graph:
        if module not in order:
            visit(module)
    return found


def test_no_modules_import_each_other():
    """A circle of imports (a -> b -> a) is one concern in two files, or a missing floor between them."""
    assert circles(import_graph()) == []


def test_the_circle_rule_sees_a_circle():
    graph = import_graph()
    assert circles(graph) == []
    graph["packfeed.server.serve.job_spec"] = graph["packfeed.server.serve.job_spec"] | {"packfeed.server.serve.jobs"}
    (found,) = circles(graph)  # job_spec -> jobs -> (datasets ->) job_spec
    assert {"packfeed.server.serve.job_spec", "packfeed.server.serve.jobs"} <= set(found)
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


# The trainer's and the client's floors, bottom up: a module imports its own floor or those below, never above.
# Trainer: the padded step shapes, the models (layer lists), their settings, parallelism applied to a layer list,
# the simulator, then the loop and what it composes. Client: three rooms, the stream (the wire and the tensors made
# of it, the channel, decoding, the receiving thread and saved states, the stream, its loaders), the model's side
# (HF model inputs, masks, CP splits, losses, towers) and the framework faces, each with floors of its own. (A
# package's __init__ re-exports its room: it stands on top.)
FLOORS = {
    "packfeed.trainer": {"batch": 0, "models": 1, "config": 2, "liveness": 2, "parallel": 3, "simulate": 4, "data": 5,
                         "metrics": 5, "checkpoint": 5, "decisions": 5, "loop": 6, "train": 7, "__main__": 8},
    "packfeed.client": {"stream": 0, "model": 1, "rollouts": 2, "frameworks": 3},
    "packfeed.client.stream": {"wire": 0, "channel": 0, "local": 0, "discovery": 0, "tensors": 1, "keywords": 1,
                               "claims": 1, "producer": 1, "loss_reports": 1, "decode": 2, "resume": 2, "receiver": 3,
                               "pack_stream": 4, "loaders": 5},
    "packfeed.client.model": {"attention": 0, "hf_config": 0, "hf_families": 0, "shared_prefix": 0, "towers": 0,
                              "context_parallel": 1, "dataset_losses": 1, "guard_updates": 1, "losses": 1, "hf": 1},
    "packfeed.client.rollouts": {"weights": 0, "prompts": 0, "engine_io": 1, "vllm_engine": 2, "vllm_server": 2,
                                 "interruptible": 2, "worker": 3},
    "packfeed.client.frameworks": {"grpo_config": 0, "grpo_prompts": 0, "grpo_rollouts": 0, "trl_vllm": 0,
                                   "hf_trainer": 0, "lightning": 0,
                                   "megatron": 0, "sft_trainer": 1, "trl": 1},
}


def floors_of(module: str) -> dict[str, int]:
    """room -> the module's floor in it, for every room with floors the module is in (a room's own __init__
    stands on top of it: on no floor there)."""
    return {room: floors[module[len(room) + 1:].split(".")[0]] for room, floors in FLOORS.items()
            if module.startswith(room + ".")}


def climbs(graph: dict[str, set[str]]) -> list[str]:
    """Imports from a floor to a higher one of the same room."""
    found = []
    for module, imported in graph.items():
        own = floors_of(module)
        for name in imported:
            for room, floor in floors_of(name).items():
                if room in own and floor > own[room]:
                    found.append(f"{module} (floor {own[room]}) imports {name} (floor {floor})")
    return sorted(found)


def test_the_trainer_and_the_client_import_no_floor_above():
    graph = import_graph()
    unplaced = sorted(module for module in graph for room, floors in FLOORS.items() if module.startswith(room + ".")
                      and module[len(room) + 1:].split(".")[0] not in floors)
    assert unplaced == [], f"modules on no floor: {unplaced} (add them to FLOORS)"
    assert climbs(graph) == []


def test_the_floor_rule_sees_a_climb():
    graph = import_graph()
    graph["packfeed.trainer.models.reference"] = graph["packfeed.trainer.models.reference"] | {"packfeed.trainer.data"}
    graph["packfeed.client.stream.tensors"] = graph["packfeed.client.stream.tensors"] | {
        "packfeed.client.stream.pack_stream", "packfeed.client.model.hf"}
    assert climbs(graph) == ["packfeed.client.stream.tensors (floor 0) imports packfeed.client.model.hf (floor 1)",
                             "packfeed.client.stream.tensors (floor 1) imports packfeed.client.stream.pack_stream "
                             "(floor 4)",
                             "packfeed.trainer.models.reference (floor 1) imports packfeed.trainer.data (floor 5)"]


def test_the_clients_flat_module_paths_still_import_the_moved_modules_with_a_warning():
    """Trainer scripts written before the client had rooms keep working: each old path gives the module at its new
    path (the same objects), and says where it moved."""
    import subprocess
    import sys

    from packfeed.client import MOVED

    assert all((REPO / "client" / (new.replace(".", "/") + ".py")).is_file() for new in MOVED.values())
    script = ("import importlib, warnings\n"
              "from packfeed.client import MOVED\n"
              "for old, new in MOVED.items():\n"
              "    with warnings.catch_warnings(record=True) as seen:\n"
              "        warnings.simplefilter('always')\n"
              "        module = importlib.import_module('packfeed.client.' + old)\n"
              "    assert module is importlib.import_module('packfeed.client.' + new), old\n"
              "    assert module.__spec__.name == 'packfeed.client.' + new, old\n"
              "    assert any(f'moved to packfeed.client.{new}' in str(w.message) for w in seen), old\n"
              "from packfeed.client.hf_trainer import PackfeedTrainer\n"
              "from packfeed.client.frameworks.hf_trainer import PackfeedTrainer as moved\n"
              "assert PackfeedTrainer is moved\n"
              "from packfeed.client.stream import PackStream\n"
              "print(len(MOVED), PackStream.__module__)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == [str(len(MOVED)), "packfeed.client.stream.pack_stream"]
