"""The gradlink Python package's shape: no import cycle among its modules, and the GRADLINK_*
environment read by one module (gradlink/_env.py), which gradlink-run shares.

The static checks read the source with `ast` (no build needed); the check that gradlink-run and
gradlink.torch.init() report a bad value alike runs them (needs the build)."""

import ast
import os
import subprocess
import sys

import pytest

from conftest import BIN, LAUNCHER, REPO

PACKAGE = os.path.join(REPO, "python", "gradlink")
ENV_MODULE = "gradlink._env"


def _modules():
    """{dotted name: path} of every module of the gradlink package."""
    found = {}
    root = os.path.dirname(PACKAGE)
    for d, _, files in os.walk(PACKAGE):
        for f in files:
            if not f.endswith(".py"):
                continue
            rel = os.path.relpath(os.path.join(d, f), root)[:-3].split(os.sep)
            if rel[-1] == "__init__":
                rel = rel[:-1]
            found[".".join(rel)] = os.path.join(d, f)
    return found


def _imports(name, path, modules):
    """The gradlink modules that module `name` imports, anywhere in it (function bodies too).
    `from P import x` imports P.x when that is a module, else P. The importer's own packages
    are left out: Python has them (being) initialized before the importer runs."""
    is_package = os.path.basename(path) == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                base = ".".join(base + ([node.module] if node.module else []))
            else:
                base = node.module
            for a in node.names:
                sub = "%s.%s" % (base, a.name)
                targets.append(sub if sub in modules else base)
        for t in targets:
            if t in modules and t != name and not name.startswith(t + "."):
                out.add(t)
    return out


def import_graph():
    modules = _modules()
    return {n: _imports(n, p, modules) for n, p in modules.items()}


def find_cycles(graph):
    """Every import cycle, one per closing edge found (each a list [a, b, ..., a])."""
    graph = {n: set(e) for n, e in graph.items()}
    found = []
    while True:
        c = find_cycle(graph)
        if c is None:
            return found
        found.append(c)
        graph[c[-2]].discard(c[-1])


def find_cycle(graph):
    """One import cycle as a list of modules [a, b, ..., a], or None."""
    state = {}  # 1: on the current path, 2: done
    path = []

    def visit(n):
        state[n] = 1
        path.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                return path[path.index(m):] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        path.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def test_the_graph_sees_the_imports():
    """The walk finds imports at module level and inside functions (so that the next test's
    silence means something)."""
    graph = import_graph()
    assert "gradlink.torch._horovod" in graph["gradlink.torch"]
    assert "gradlink.torch._horovod" in graph["gradlink.byteps.torch"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle():
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_every_name_used_from_core_is_there(built):
    """_core is split by concern and re-exports what the other front ends, the tests, the
    benchmarks and the examples take from it (gradlink.torch._core.X, `from ._core import X`):
    every such name, found in the source, is still there."""
    import gradlink.torch
    from gradlink.torch import _core
    used = set()
    for top in ("python", "tests", "bench", "examples"):
        for d, _, files in os.walk(os.path.join(REPO, top)):
            for f in files:
                if not f.endswith(".py"):
                    continue
                tree = ast.parse(open(os.path.join(d, f)).read())
                for node in ast.walk(tree):
                    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                            and node.value.id == "_core":
                        used.add(node.attr)
                    elif isinstance(node, ast.Attribute) and node.attr != "_core" and \
                            isinstance(node.value, ast.Attribute) and node.value.attr == "_core":
                        used.add(node.attr)
                    elif isinstance(node, ast.ImportFrom) and (node.module or "").endswith(
                            "_core"):
                        used.update(a.name for a in node.names)
    assert {"staging_stats", "stats", "start_collective", "_require"} <= used, used
    missing = sorted(n for n in used if not hasattr(_core, n))
    assert not missing, "gone from gradlink.torch._core: %s" % missing
    missing = sorted(n for n in gradlink.torch.__all__ if not hasattr(gradlink.torch, n))
    assert not missing, "gone from gradlink.torch: %s" % missing


# -- The environment ---------------------------------------------------------------------------

ENV_FILE = os.path.join(PACKAGE, "_env.py")


def _environ_uses(path):
    """(line, what) for every access to the process environment in `path` that names a
    GRADLINK_* variable, or whose name is not a constant: os.environ[...], os.environ.get(...)
    (pop, setdefault, ...), os.getenv(...), os.putenv(...), "..." in os.environ. Copying the
    whole environment (dict(os.environ, ...)) is not an access to a variable."""

    def is_environ(n):
        return isinstance(n, ast.Attribute) and n.attr == "environ"

    def named(key):
        if isinstance(key, ast.Constant) and isinstance(key.value, str):
            return key.value.startswith("GRADLINK_"), key.value
        return True, ast.unparse(key)  # not a constant: it may name one

    uses = []
    for node in ast.walk(ast.parse(open(path).read(), path)):
        key = None
        if isinstance(node, ast.Subscript) and is_environ(node.value):
            key = node.slice
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args \
                and (is_environ(node.func.value) or node.func.attr in ("getenv", "putenv")):
            key = node.args[0]
        elif isinstance(node, ast.Compare) and any(is_environ(c) for c in node.comparators):
            key = node.left
        if key is not None:
            bad, what = named(key)
            if bad:
                uses.append((node.lineno, what))
    return uses


def _python_sources():
    yield os.path.join(REPO, "tools", "gradlink-run")
    for d, _, files in os.walk(os.path.join(REPO, "python")):
        for f in files:
            if f.endswith(".py"):
                yield os.path.join(d, f)


def test_the_scan_sees_environment_reads(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text('import os\nos.environ.get("GRADLINK_A")\nos.environ["GRADLINK_B"] = "1"\n'
                      'x = "GRADLINK_C" in os.environ\nos.getenv(name)\nos.environ.get("HOME")\n'
                      'dict(os.environ, GRADLINK_D="1")\n')
    assert _environ_uses(str(sample)) == [(2, "GRADLINK_A"), (3, "GRADLINK_B"),
                                          (4, "GRADLINK_C"), (5, "name")]


def test_only_the_env_module_reads_gradlink_variables():
    """GRADLINK_* is parsed once for Python: gradlink/_env.py reads (and sets) the variables;
    every other module of python/ and gradlink-run asks it."""
    found = {os.path.relpath(p, REPO): u for p in _python_sources() if p != ENV_FILE
             for u in [_environ_uses(p)] if u}
    assert not found, "GRADLINK_* read outside gradlink/_env.py: %s" % found
    assert _environ_uses(ENV_FILE), "the scan found nothing in gradlink/_env.py itself"


def _launcher_says(env, tmp_path):
    """What gradlink-run says on stderr about `env`, and whether anything started."""
    p = subprocess.run([sys.executable, LAUNCHER, "--bin-dir", BIN, "-n", "1", "-s", "1", "--",
                        sys.executable, "-c", "print('worker ran')"], env=env, cwd=str(tmp_path),
                       capture_output=True, text=True, timeout=60)
    said = [line[len("gradlink-run: "):] for line in p.stderr.splitlines()
            if line.startswith("gradlink-run: ")]
    return p.returncode, said, p.stdout + p.stderr


def _python_says(env, code, tmp_path):
    """The InvalidArgumentError that `code` (gradlink.torch imported as gl) raises under `env`."""
    script = ("import gradlink\nimport gradlink.torch as gl\nfrom gradlink.torch import _staging\n"
              "try:\n    %s\nexcept gl.InvalidArgumentError as e:\n    print('ERROR', e)\n"
              % code)
    p = subprocess.run([sys.executable, "-c", script], env=env, cwd=str(tmp_path),
                       capture_output=True, text=True, timeout=60)
    said = [line[len("ERROR "):] for line in p.stdout.splitlines() if line.startswith("ERROR ")]
    assert said, "no InvalidArgumentError:\n" + p.stdout + p.stderr
    return said[0]


@pytest.mark.parametrize("name,value,expected,code", [
    # Options of the C++ worker (parsed by gradlink::ApplyEnvironment through the extension).
    ("GRADLINK_PARTITION_BYTES", "12Q",
     "GRADLINK_PARTITION_BYTES='12Q' is not a byte count", "gl.init(scheduler='127.0.0.1:1')"),
    ("GRADLINK_TIMEOUT", "soon", "GRADLINK_TIMEOUT='soon' is not a finite number",
     "gl.init(scheduler='127.0.0.1:1')"),
    # Variables of the Python layer alone (parsed by gradlink/_env.py).
    ("GRADLINK_STAGING_CHUNK_BYTES", "12",
     "GRADLINK_STAGING_CHUNK_BYTES='12': expected bytes >= 1024", "_staging.chunk_bytes()"),
    ("GRADLINK_C10D_SLOTS", "0", "GRADLINK_C10D_SLOTS=0: at least 1",
     "gradlink._env.c10d_slots()"),
])
def test_a_bad_value_is_reported_alike_by_gradlink_run_and_its_reader(built, tmp_path, name,
                                                                     value, expected, code):
    """gradlink-run parses what its members will, with their parser, and refuses a malformed
    value before it starts anything, in the words of the member that reads it."""
    env = dict(os.environ, PYTHONPATH=os.path.join(REPO, "python"), GRADLINK_FAIL_FAST="0")
    env[name] = value
    rc, launcher, text = _launcher_says(env, tmp_path)
    assert rc != 0, text
    assert "worker ran" not in text and "[scheduler]" not in text, text  # nothing started
    member = _python_says(env, code, tmp_path)
    assert expected in member, member
    assert launcher == [member], text
