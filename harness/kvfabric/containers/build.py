"""Build kvfabric's four images from ``images/*/Dockerfile`` in the private engine.

Each build runs the Dockerfile unchanged (``docker build --network=host``: the engine has no bridge)
on the local base images of :mod:`kvfabric.containers.base`, and labels the result with a digest of
its inputs: the Dockerfile, every file of the build context (``.dockerignore``'s allow-list), the
base images' ids and the build arguments that change bytes. A warm machine whose image carries the
current digest skips the build entirely.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from kvfabric.cli.version import __version__
from kvfabric.containers.base import BUSYBOX_IMAGE, DIGEST_LABEL, PYTHON_IMAGE, image_digest
from kvfabric.containers.engine import DockerEngine
from kvfabric.containers.progress import run_step

REPO_ROOT = Path(__file__).resolve().parents[3]
TAG = f"v{__version__}"
# The context paths .dockerignore lets in (it is an allow-list; the test of this module checks that
# the two agree).
CONTEXT_PATHS = (
    "pyproject.toml",
    "uv.lock",
    "README.md",
    "operator",
    "cacheserver",
    "connector",
    "harness",
    "images",
)
_SKIP_PARTS = {"__pycache__", ".mypy_cache", ".pytest_cache", ".ruff_cache"}
# PyPI serves torch as its CUDA build only (the PyTorch CPU index is not reachable here): "lock"
# makes the engine image install torch and its nvidia-* wheels exactly as uv.lock pins them.
TORCH_SOURCE_LOCK = "lock"


@dataclass(frozen=True)
class Image:
    """One of the images: its directory under images/ and its full name."""

    directory: str
    repository: str

    @property
    def ref(self) -> str:
        """``repository:tag``."""
        return f"{self.repository}:{TAG}"

    @property
    def dockerfile(self) -> Path:
        """Its Dockerfile."""
        return REPO_ROOT / "images" / self.directory / "Dockerfile"


def images(root: Path = REPO_ROOT) -> list[Image]:
    """The images listed in ``images/images.txt``, in its order."""
    out = []
    for raw in (root / "images" / "images.txt").read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if line:
            directory, repository = line.split()
            out.append(Image(directory, repository))
    return out


def copied_paths(dockerfile: Path) -> list[str]:
    """The build-context paths a Dockerfile's ``COPY``/``ADD`` instructions read (not ``--from``)."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    out: list[str] = []
    for line in text.splitlines():
        words = line.split()
        if len(words) < 3 or words[0].upper() not in ("COPY", "ADD"):
            continue
        args = [w for w in words[1:] if not w.startswith("--")]
        if any(w.startswith("--from") for w in words[1:]):
            continue
        out += [a.rstrip("/") for a in args[:-1]]
    return out


def _context_files(root: Path, sources: list[str]) -> Iterator[Path]:
    for name in sources:
        for p in sorted(root.glob(name)) if any(c in name for c in "*?[") else [root / name]:
            if p.is_file():
                yield p
            elif p.is_dir():
                for f in sorted(p.rglob("*")):
                    skipped = _SKIP_PARTS & set(f.relative_to(root).parts) or f.suffix in (".pyc", ".pyo")
                    if f.is_file() and not skipped:
                        yield f


def build_args(image: Image, torch_source: str | None) -> dict[str, str]:
    """The ``--build-arg`` values for one image (``TORCH_INDEX_URL`` only for the engine)."""
    args = {"KVFABRIC_VERSION": __version__}
    if image.directory == "engine" and torch_source:
        args["TORCH_INDEX_URL"] = torch_source
    return args


def inputs_digest(eng: DockerEngine, image: Image, args: dict[str, str], root: Path = REPO_ROOT) -> str:
    """A digest of everything the image's bytes depend on.

    The Dockerfile, the context files its ``COPY`` lines read, the base images' ids and the build
    arguments; a file no ``COPY`` names (e.g. the harness, for the product images) does not count.
    """
    h = hashlib.sha256(image.dockerfile.read_bytes())
    for f in _context_files(root, copied_paths(image.dockerfile)):
        h.update(str(f.relative_to(root)).encode() + b"\0" + hashlib.sha256(f.read_bytes()).digest())
    for base in (PYTHON_IMAGE, BUSYBOX_IMAGE):
        out = eng.docker("image", "inspect", "--format", "{{.Id}}", base, check=False)
        h.update(out.stdout.strip().encode())
    h.update(json.dumps(args, sort_keys=True).encode())
    h.update(str(image.dockerfile.relative_to(root)).encode())
    return h.hexdigest()[:16]


def revision(root: Path = REPO_ROOT) -> str:
    """The checkout's commit, for the OCI revision label.

    Not part of the digest: an image reused on a later commit carries the first commit built with
    the same inputs.
    """
    out = subprocess.run(
        ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, check=False
    )
    return out.stdout.strip() or "unknown"


def image_size(eng: DockerEngine, ref: str) -> int:
    """The image's size in bytes as the engine reports it."""
    return int(eng.docker("image", "inspect", "--format", "{{.Size}}", ref).stdout.strip())


def build(
    eng: DockerEngine,
    image: Image,
    *,
    torch_source: str | None = TORCH_SOURCE_LOCK,
    force: bool = False,
    say: Callable[[str], None] | None = None,
) -> bool:
    """Build one image unless its current inputs are already built; True when it built."""
    say = say or (lambda msg: print(f"[images] {msg}", file=sys.stderr, flush=True))
    args = build_args(image, torch_source)
    digest = inputs_digest(eng, image, args)
    if not force and image_digest(eng, image.ref) == digest:
        say(f"{image.ref} is current ({image_size(eng, image.ref) / 1e6:.0f} MB)")
        return False
    argv = [eng.docker_path, "build", "--network=host", "-f", str(image.dockerfile), "-t", image.ref]
    for k, v in {**args, "REVISION": revision()}.items():
        argv += ["--build-arg", f"{k}={v}"]
    argv += ["--label", f"{DIGEST_LABEL}={digest}", str(REPO_ROOT)]
    run_step(f"build {image.directory}", argv, env=eng.env, keep_line=_keep_build_line)
    say(f"{image.ref}: {image_size(eng, image.ref) / 1e6:.0f} MB")
    keep_build_cache(eng, image, argv)
    return True


def build_cache_ref(image: Image) -> str:
    """The tag kept on an image's builder stage."""
    return f"kvfabric-local/build-cache:{image.directory}"


def keep_build_cache(eng: DockerEngine, image: Image, argv: list[str]) -> None:
    """Tag the builder stage, whose layers are the next build's cache.

    They hold the locked requirements (GBs for the engine); untagged, :func:`prune` would take them.
    """
    tagged = [a for a in argv if a not in ("-t", image.ref)]
    eng.docker("build", "--target", "builder", "-t", build_cache_ref(image), *tagged[2:], check=False)


def prune(eng: DockerEngine) -> None:
    """Drop untagged images (earlier builds' leftovers), so the cache directory does not grow."""
    eng.docker("image", "prune", "-f", check=False)


def _keep_build_line(line: str) -> bool:
    """Steps, pip's 'Collecting'/'Downloading' summaries and errors; not progress bars or blanks."""
    s = line.strip()
    noise = ("━", "|", "---> Running in", "Removing intermediate", "--hash=", "# via", "#   ")
    return bool(s) and not s.startswith(noise)
