"""Reading the user's text files (held-out text, calibration text) with errors that name the problem."""

from pathlib import Path


def read_utf8(path: str | Path, what: str) -> tuple[str, bytes]:
    """The text and raw bytes of ``path``; ``ValueError`` naming ``what`` when the file is missing or
    not UTF-8."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{what} {path} does not exist")
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8"), raw
    except UnicodeDecodeError as err:
        raise ValueError(f"{what} {path} is not UTF-8 (byte {err.start}: {raw[err.start:err.start + 1]!r})") from err
