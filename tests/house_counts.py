"""The counts issue [2/6] of the sixth wave tracks, read off the product code (run: python tests/house_counts.py):
how often serving asks which kind of plan it has, what a rank-step's work carries, where the server imports
client code, how many attributes are set on an object from outside it after it was built, and where a plan's
sharing of prefixes is decided. The files a live sample crosses from `Producer.put` to the trainer's pack are
measured on a real run by tests/live_sample_files.py."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from test_layout import REPO, imported_modules, module_of, project_modules  # noqa: E402


def _trees() -> dict[Path, ast.AST]:
    return {path: ast.parse(path.read_text(), str(path)) for path in project_modules()}


def plan_kind_checks(trees) -> int:
    """isinstance(..., WindowedPlan | LivePlan | Plan) calls."""
    kinds = {"WindowedPlan", "LivePlan", "Plan"}
    return sum(1 for tree in trees.values() for node in ast.walk(tree)
               if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "isinstance" and len(node.args) == 2
               and any(getattr(n, "id", "") in kinds for n in ast.walk(node.args[1])))


def rank_step_work_fields() -> int:
    from packfeed.server.serve.step_work import RankStepWork

    return len(RankStepWork.__dataclass_fields__)


def server_imports_of_client_code() -> list[str]:
    modules = {module_of(path) for path in project_modules()}  # a `from m import name` counts m, not m.name too
    return sorted(f"{path.relative_to(REPO)}: {name}" for path in project_modules()
                  if module_of(path).startswith("packfeed.server.")
                  for name in imported_modules(path) if name.startswith("packfeed.client") and name in modules)


WIRED = ("plan", "job", "work", "dataset", "source", "evicted", "steps", "live", "ledger", "draws", "reads")


def attributes_set_from_outside(trees) -> list[str]:
    """`x.attr = ...` in a server module where x is one of the serving objects (a plan, a job, its source, a
    rank-step's work, its reads, the live steps, a ledger or draws) reached from outside it: wiring an object after
    it was built (a record filled in by its own builder, or a parsed message, is not counted)."""
    found = []
    for path, tree in trees.items():
        if not module_of(path).startswith("packfeed.server."):
            continue
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, (ast.AugAssign, ast.AnnAssign)) else []
            for target in targets:
                for each in ast.walk(target):
                    base = each.value if isinstance(each, ast.Attribute) else None
                    while isinstance(base, ast.Attribute):
                        base = base.value
                    chain = ast.unparse(each.value) if isinstance(each, ast.Attribute) else ""
                    if isinstance(each, ast.Attribute) and isinstance(each.ctx, ast.Store) and \
                            isinstance(base, ast.Name) and (base.id in WIRED or any(
                                f".{name}" in chain for name in WIRED)) and base.id not in ("cls",):
                        found.append(f"{path.relative_to(REPO)}:{node.lineno} {ast.unparse(each)}")
    return found


def shared_prefix_decisions(trees) -> list[str]:
    """`... and <x>.shared_prefix`: a place deciding whether a plan shares its groups' prefixes (the flag with
    another condition), anywhere in the product code."""
    return sorted(f"{path.relative_to(REPO)}:{node.lineno}" for path, tree in trees.items() for node in ast.walk(tree)
                  if isinstance(node, ast.BoolOp) and isinstance(node.op, ast.And) and any(
                      isinstance(value, ast.Attribute) and value.attr == "shared_prefix" for value in node.values))


# Objects of the standard library whose handles the server reads by getattr because no public one exists (a
# platform's mmap flag, the process pool's and the fork server's internals): not product objects.
LIBRARY_OBJECTS = {"mmap", "self.executor", "forkserver", "server"}


def getattr_probes(trees) -> list[str]:
    """getattr(x, "name", default) on product objects in the server's serving and live rooms."""
    return sorted(f"{path.relative_to(REPO)}:{node.lineno} {ast.unparse(node)}"
                  for path, tree in trees.items()
                  if module_of(path).startswith(("packfeed.server.serve", "packfeed.server.live"))
                  for node in ast.walk(tree) if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "getattr"
                  and len(node.args) == 3 and ast.unparse(node.args[0]) not in LIBRARY_OBJECTS)


def main() -> None:
    trees = _trees()
    print(f"isinstance checks on plan kinds: {plan_kind_checks(trees)}")
    print(f"RankStepWork fields: {rank_step_work_fields()}")
    client = server_imports_of_client_code()
    print(f"server imports of client code (the command line, packfeed.cli, is not the server): {len(client)}"
          + "".join(f"\n  {c}" for c in client))
    outside = attributes_set_from_outside(trees)
    print(f"attributes set from outside an object in the server: {len(outside)}" + "".join(f"\n  {a}" for a in outside))
    decisions = shared_prefix_decisions(trees)
    print(f"shared-prefix decisions: {len(decisions)}" + "".join(f"\n  {d}" for d in decisions))
    probes = getattr_probes(trees)
    print(f"getattr probes with a default on product objects in serve/ and live/: {len(probes)}"
          + "".join(f"\n  {p}" for p in probes))


if __name__ == "__main__":
    main()
