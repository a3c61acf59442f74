"""An offline training corpus: Python sources the host already has, docstrings included.

By default the standard library, then the installed packages (``site-packages``): every host
with Python has them, so the corpus needs no network and no shipped data. The standard library
alone is about 2.6 M tokens, which a five-minute run on the H200 passes over about 70 times (the
first reference model over-fitted: train loss 0.12, held-out 4.09), so the packages are added up
to the byte budget. Files are read root by root in sorted order, decoded as UTF-8 (others
skipped), and assigned to the held-out split by a hash of their path relative to their root, so
the split is stable across runs; another host (other Python or package versions) gets other
text under the same split rule.
"""

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

SKIP_PARTS = {"site-packages", "dist-packages", "__pycache__", "idlelib", "turtledemo"}


@dataclass
class Corpus:
    train: list[str]
    heldout: list[str]

    def sizes(self) -> tuple[int, int]:
        return sum(map(len, self.train)), sum(map(len, self.heldout))


def default_roots() -> list[Path]:
    """This Python's standard library, then its installed packages."""
    paths = sysconfig.get_paths()
    return [Path(paths["stdlib"]), *([Path(paths["purelib"])] if paths["purelib"] != paths["stdlib"] else [])]


def _sources(root: Path):
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if not SKIP_PARTS.intersection(rel.parts):
            yield path, rel


def build_corpus(roots: Path | list[Path] | None = None, heldout_percent: int = 2, max_bytes: int = 96 << 20) -> Corpus:
    """Collect ``*.py`` files under ``roots`` (``default_roots()`` if None) into train /
    held-out texts.

    ``heldout_percent`` of the files (by path hash) go to the held-out split; reading stops
    once ``max_bytes`` of text were collected. Raises ``ValueError`` when nothing is found or
    the held-out split comes out empty.
    """
    roots = default_roots() if roots is None else [Path(r) for r in (roots if isinstance(roots, list) else [roots])]
    train, heldout, total = [], [], 0
    for path, rel in (item for root in roots for item in _sources(root)):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if not text.strip():
            continue
        bucket = int(hashlib.sha256(str(rel).encode()).hexdigest(), 16) % 100
        (heldout if bucket < heldout_percent else train).append(text)
        total += len(text)
        if total >= max_bytes:
            break
    if not train or not heldout:
        raise ValueError(f"no usable corpus under {', '.join(map(str, roots))}: {len(train)} train and "
                         f"{len(heldout)} held-out files")
    return Corpus(train, heldout)
