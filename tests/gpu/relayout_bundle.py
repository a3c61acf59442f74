"""Lay an offline bundle (../shared/gpu/bundle.sh's output) out again in smaller parts, so that a part and the
working tree fit in the 64 MiB a device call carries. bundle.sh writes parts of up to 57 MiB; with a tree of
more than 7 MiB those do not fit.

    python3 tests/gpu/relayout_bundle.py .gpu/vllm [--part-mib 55] [--piece-mb 45]

Split wheels are joined and cut again into pieces of --piece-mb MB (install.sh joins ``*.piece*``); every file
then goes first fit, largest first, into parts p1, p2, ... of at most --part-mib MiB, each with the bundle's
stage.sh, and install.sh into the last part. The bundle folder is replaced in place.
"""
import argparse
import shutil
from pathlib import Path


def relayout(bundle: Path, part_bytes: int, piece_bytes: int) -> list[int]:
    flat = bundle.with_name(bundle.name + ".flat")
    shutil.rmtree(flat, ignore_errors=True)
    flat.mkdir()
    parts = sorted(p for p in bundle.iterdir() if p.is_dir())
    stage, install = parts[0] / "stage.sh", next(bundle.glob("p*/install.sh"))
    pieces: dict[str, list[Path]] = {}
    for f in (f for p in parts for f in p.iterdir() if f.name not in ("stage.sh", "install.sh")):
        wheel, _, _ = f.name.partition(".piece")
        pieces.setdefault(wheel, []).append(f)
    for wheel, files in pieces.items():
        data = b"".join(f.read_bytes() for f in sorted(files, key=lambda f: f.name))
        if len(data) <= piece_bytes:
            (flat / wheel).write_bytes(data)
            continue
        for i, off in enumerate(range(0, len(data), piece_bytes)):
            (flat / f"{wheel}.piece{i:02d}").write_bytes(data[off:off + piece_bytes])
    bins: list[list] = []
    for f in sorted(flat.iterdir(), key=lambda f: -f.stat().st_size):
        size = f.stat().st_size
        target = next((b for b in bins if b[0] + size <= part_bytes), None)
        if target is None:
            target = [0, []]
            bins.append(target)
        target[0] += size
        target[1].append(f)
    out = bundle.with_name(bundle.name + ".new")
    shutil.rmtree(out, ignore_errors=True)
    for n, (_, files) in enumerate(bins, 1):
        part = out / f"p{n}"
        part.mkdir(parents=True)
        shutil.copy2(stage, part)
        for f in files:
            f.rename(part / f.name)
    shutil.copy2(install, out / f"p{len(bins)}")
    shutil.rmtree(bundle)
    shutil.rmtree(flat)
    out.rename(bundle)
    return [sum(f.stat().st_size for f in (bundle / f"p{n}").iterdir()) for n in range(1, len(bins) + 1)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundle", type=Path)
    parser.add_argument("--part-mib", type=int, default=55)
    parser.add_argument("--piece-mb", type=int, default=45)
    args = parser.parse_args()
    for n, size in enumerate(relayout(args.bundle, args.part_mib << 20, args.piece_mb * 10**6), 1):
        print(f"p{n}: {size / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
