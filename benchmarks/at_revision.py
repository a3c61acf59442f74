"""``common_kernels/mla`` modules as they are at a git revision, importable beside the working tree's: the base
side of the A/B benchmarks (``mla_decode_ab``, ``mla_prefill --base``).

A revision is a git revision, or a folder of copies of the modules (for a machine whose git history is missing or
stale: ``git show REV:common_kernels/mla/NAME.py > DIR/NAME.py``, made where the history is right).
"""

import importlib.util
import linecache
import subprocess
import sys
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def revision_source(revision: str, name: str) -> str:
    """Module ``name``'s source at ``revision``."""
    if Path(revision).is_dir():
        path = Path(revision) / f"{name}.py"
        if path.is_file():
            return path.read_text()
    else:
        shown = subprocess.run(["git", "show", f"{revision}:common_kernels/mla/{name}.py"], cwd=REPO,
                               capture_output=True, text=True)
        if shown.returncode == 0:
            return shown.stdout
    raise ValueError(f"--base {revision}: no {name}.py there")


def exec_at_base(revision: str, name: str, source: str) -> types.ModuleType:
    """``source`` run as module ``common_kernels.mla.<name>_at_base`` (its relative imports resolve against the
    working tree's package), its source readable for jit."""
    qualified = f"common_kernels.mla.{name}_at_base"
    path = REPO / "common_kernels" / "mla" / f"{name}_at_base.py"  # the name the compilers' errors show; not written
    spec = importlib.util.spec_from_loader(qualified, loader=None, origin=str(path))
    module = importlib.util.module_from_spec(spec)
    module.__package__ = "common_kernels.mla"
    sys.modules[qualified] = module
    linecache.cache[str(path)] = (len(source), None, source.splitlines(True), str(path))  # for jit's getsource
    try:
        exec(compile(source, str(path), "exec"), module.__dict__)  # noqa: S102 (our own source at a revision)
    except ImportError as error:
        raise ValueError(f"--base {revision}: its {name}.py imports what the working tree no longer has "
                         f"({error}); compare with a newer revision") from error
    return module
