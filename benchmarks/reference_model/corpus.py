"""An offline training corpus: the Python standard library's own sources, docstrings included.

Every host with Python has it, so the corpus needs no network and no shipped data. Files are
read in sorted order, decoded as UTF-8 (others skipped), and assigned to the held-out split by a
hash of their relative path, so the split is stable across runs and hosts (a host with another
Python patch release gets slightly different text, the same split rule).
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


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def build_corpus(root: Path | None = None, heldout_percent: int = 2, max_bytes: int = 64 << 20) -> Corpus:
    """Collect ``*.py`` files under ``root`` (the stdlib by default) into train / held-out texts.

    ``heldout_percent`` of the files (by path hash) go to the held-out split; reading stops
    once ``max_bytes`` of text were collected. Raises ``ValueError`` when nothing is found or
    the held-out split comes out empty.
    """
    root = Path(root) if root is not None else stdlib_root()
    train, heldout, total = [], [], 0
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if SKIP_PARTS.intersection(rel.parts):
            continue
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
        raise ValueError(f"no usable corpus under {root}: {len(train)} train and {len(heldout)} held-out files")
    return Corpus(train, heldout)
