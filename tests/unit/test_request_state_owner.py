"""One owner for a request's state: no module of engine_core but the Scheduler's
(sched/scheduler.py) and Request's own (sched/request.py) changes a Request's fields. The sched
package is where the temptation lives; the KV-cache managers, which receive requests, and every
other engine module are held to the same rule.

The checker parses every module under a root, so the tests below also run it on a planted tree.
Request's fields are the names in its `__slots__`, read from request.py. In any other module it
reports, on `<expr>.<field>` where `<expr>` is not the bare name `self`:
- an assignment, augmented or annotated assignment, `del`, or a loop, comprehension or `with`
  target, unpacked targets included;
- an item assignment or `del` on the field (`<expr>.block_hashes[0] = ...`);
- a call of a mutating method on the field (`<expr>.all_token_ids.append(...)`);
- a call of one of Request's own commands (`<expr>.append_output_token_id(...)`);
and any `setattr(<expr>, "<field>", ...)`. `self.<field>` is another class's own attribute of
that name (RequestIntake.eos_token_ids), except inside a class that derives from Request, where
it is reported too.
"""

import ast
import pathlib

from engine_core.sched.request import Request

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = "engine_core"
REQUEST_MODULE = f"{PACKAGE}/sched/request.py"
OWNER_MODULES = (f"{PACKAGE}/sched/scheduler.py", REQUEST_MODULE)  # exactly the owners
# Request's methods that change it; the owners call them, nobody else does.
REQUEST_COMMANDS = frozenset({"append_output_token_id", "append_output_token_ids"})
# Methods of the fields' types (array, list, set, dict) that change the object in place.
MUTATING_METHODS = frozenset(
    {
        "append",
        "extend",
        "insert",
        "pop",
        "remove",
        "clear",
        "sort",
        "reverse",
        "fromlist",
        "frombytes",
        "byteswap",
        "add",
        "discard",
        "update",
        "setdefault",
        "popitem",
    }
)


def request_fields(root: pathlib.Path) -> frozenset[str]:
    """The names in `Request.__slots__`, as request.py under `root` declares them."""
    tree = ast.parse((root / REQUEST_MODULE).read_text())
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "Request":
            for statement in node.body:
                if (
                    isinstance(statement, ast.Assign)
                    and len(statement.targets) == 1
                    and isinstance(statement.targets[0], ast.Name)
                    and statement.targets[0].id == "__slots__"
                ):
                    return frozenset(ast.literal_eval(statement.value))
    raise AssertionError(f"no Request.__slots__ in {REQUEST_MODULE}")


def _targets(node: ast.AST) -> list[ast.expr]:
    """The expressions a statement or comprehension binds, assigns or deletes."""
    match node:
        case ast.Assign(targets=targets) | ast.Delete(targets=targets):
            return list(targets)
        case ast.AugAssign(target=target) | ast.AnnAssign(target=target):
            return [target]
        case (
            ast.For(target=target) | ast.AsyncFor(target=target) | ast.comprehension(target=target)
        ):
            return [target]
        case ast.withitem(optional_vars=ast.expr() as target):
            return [target]
    return []


def _flatten(target: ast.expr) -> list[ast.expr]:
    """`a, (b.c, *d.e)` -> [a, b.c, d.e]."""
    match target:
        case ast.Tuple(elts=elts) | ast.List(elts=elts):
            return [leaf for elt in elts for leaf in _flatten(elt)]
        case ast.Starred(value=value):
            return _flatten(value)
    return [target]


class _Writes(ast.NodeVisitor):
    """Collects the writes to Request fields in one module, as `line: what` strings."""

    def __init__(self, fields: frozenset[str]) -> None:
        self.fields = fields
        self.found: list[tuple[int, str]] = []
        self._in_request_subclass = [False]

    def _is_foreign(self, owner: ast.expr) -> bool:
        """Whether `<owner>.<field>` may be a Request's: anything but this class's own `self`."""
        is_self = isinstance(owner, ast.Name) and owner.id == "self"
        return not is_self or self._in_request_subclass[-1]

    def _field_of(self, node: ast.expr) -> str | None:
        """The field `node` names when it is `<expr>.<field>` on a possible Request."""
        is_field = isinstance(node, ast.Attribute) and node.attr in self.fields
        return node.attr if is_field and self._is_foreign(node.value) else None

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        derives = any(ast.unparse(base).split(".")[-1] == "Request" for base in node.bases)
        self._in_request_subclass.append(derives)
        self.generic_visit(node)
        self._in_request_subclass.pop()

    def generic_visit(self, node: ast.AST) -> None:
        for target in _targets(node):
            for leaf in _flatten(target):
                if (field := self._field_of(leaf)) is not None:
                    self.found.append((leaf.lineno, f"assigns {field}"))
                elif (
                    isinstance(leaf, ast.Subscript)
                    and (field := self._field_of(leaf.value)) is not None
                ):
                    self.found.append((leaf.lineno, f"assigns an item of {field}"))
        if isinstance(node, ast.Call):
            self._check_call(node)
        super().generic_visit(node)

    def _check_call(self, call: ast.Call) -> None:
        function = call.func
        if isinstance(function, ast.Attribute):
            if function.attr in REQUEST_COMMANDS and self._is_foreign(function.value):
                self.found.append((call.lineno, f"calls {function.attr}"))
            elif (
                function.attr in MUTATING_METHODS
                and (field := self._field_of(function.value)) is not None
            ):
                self.found.append((call.lineno, f"calls {field}.{function.attr}"))
        elif (
            isinstance(function, ast.Name)
            and function.id == "setattr"
            and len(call.args) >= 2
            and isinstance(call.args[1], ast.Constant)
            and call.args[1].value in self.fields
        ):
            self.found.append((call.lineno, f"sets {call.args[1].value} with setattr"))


def request_state_violations(root: pathlib.Path) -> list[str]:
    """Each write to a Request field outside the owner modules, as `path:line what`."""
    fields = request_fields(root)
    violations = []
    for path in sorted((root / PACKAGE).rglob("*.py")):
        name = path.relative_to(root).as_posix()
        if name in OWNER_MODULES:
            continue
        writes = _Writes(fields)
        writes.visit(ast.parse(path.read_text(), filename=str(path)))
        violations.extend(f"{name}:{line} {what}" for line, what in sorted(writes.found))
    return violations


def test_only_the_scheduler_and_request_change_a_request() -> None:
    assert request_fields(ROOT) == frozenset(Request.__slots__)
    violations = request_state_violations(ROOT)
    assert not violations, "\n".join(violations)


def test_request_commands_are_request_methods() -> None:
    """A renamed command would leave the checker looking for a name nobody calls."""
    assert all(callable(getattr(Request, name, None)) for name in REQUEST_COMMANDS)


def _plant(root: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


PLANTED_REQUEST = """\
class Request:
    __slots__ = ("status", "num_computed_tokens", "all_token_ids", "block_hashes", "priority")

    def append_output_token_id(self, token_id):
        self.all_token_ids.append(token_id)
"""

PLANTED_STEP = """\
from engine_core.sched.request import Request


class Step:
    def __init__(self, requests, priority):
        self.requests = requests
        self.priority = priority  # this class's own attribute: not a Request's

    def apply(self, sampled):
        for request, token_id in zip(self.requests, sampled):
            request.append_output_token_id(token_id)
            request.num_computed_tokens += 1
            if request.status == 1 and self.priority:  # reading is fine
                request.status = 2
        self.requests[0].all_token_ids.extend(sampled)
        first, self.requests[-1].priority = sampled[0], 0
        del self.requests[0].block_hashes[0]
        setattr(self.requests[0], "status", 3)
        return [request.status for request in self.requests]


class Resumed(Request):
    def reset(self):
        self.num_computed_tokens = 0
"""


def test_checker_reports_request_writes_planted_outside_the_owners(
    tmp_path: pathlib.Path,
) -> None:
    root = _plant(
        tmp_path,
        {
            "engine_core/sched/__init__.py": "",
            "engine_core/sched/request.py": PLANTED_REQUEST,
            "engine_core/sched/scheduler.py": (
                "def preempt(request):\n"
                "    request.status = 2\n"
                "    request.num_computed_tokens = 0\n"
            ),
            "engine_core/sched/step.py": PLANTED_STEP,
            "engine_core/sched/reader.py": (
                "def count(requests):\n"
                "    return sum(request.num_computed_tokens for request in requests)\n"
            ),
            "engine_core/kv_cache/manager.py": (
                "def allocate(request, num_tokens):\n"
                "    request.num_computed_tokens += num_tokens\n"
            ),
        },
    )
    assert request_state_violations(root) == [
        "engine_core/kv_cache/manager.py:2 assigns num_computed_tokens",
        "engine_core/sched/step.py:11 calls append_output_token_id",
        "engine_core/sched/step.py:12 assigns num_computed_tokens",
        "engine_core/sched/step.py:14 assigns status",
        "engine_core/sched/step.py:15 calls all_token_ids.extend",
        "engine_core/sched/step.py:16 assigns priority",
        "engine_core/sched/step.py:17 assigns an item of block_hashes",
        "engine_core/sched/step.py:18 sets status with setattr",
        "engine_core/sched/step.py:24 assigns num_computed_tokens",
    ]
    (root / "engine_core/sched/step.py").write_text(
        "class Step:\n    def __init__(self, priority):\n        self.priority = priority\n"
    )
    (root / "engine_core/kv_cache/manager.py").write_text(
        "def allocate(request, num_tokens):\n    return request.num_computed_tokens + num_tokens\n"
    )
    assert request_state_violations(root) == []
