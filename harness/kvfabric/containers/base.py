"""Base images made on this machine, so that no image build pulls from a registry.

No container registry is reachable where kvfabric's CI runs, only Debian's mirror, PyPI and the Go
module proxy. The images' Dockerfiles start ``FROM python:3.12-slim-bookworm`` and
``FROM busybox:1.37.0``; this module builds local stand-ins under exactly those names, in the
harness's private engine only (its own data root), so the Dockerfiles build unchanged:

- ``kvfabric-local/debian:bookworm``: ``debootstrap --variant=minbase bookworm`` plus the shared
  libraries CPython's extension modules load, imported with ``docker import``;
- ``python:3.12-slim-bookworm``: that Debian with a CPython 3.12 copied into ``/usr/local`` (Debian
  bookworm ships 3.11 only; the copy comes from this machine, see :func:`find_cpython`), pip from
  ``ensurepip``, and this machine's CA bundle (``PIP_CERT``, ``SSL_CERT_FILE``), without which TLS to
  PyPI fails behind the intercepting proxy here;
- ``busybox:1.37.0``: Debian's ``busybox-static`` (1.35) in a ``FROM scratch`` image.

Each image carries a label with the digest of its inputs; a warm machine whose images carry the
current digest skips the step. The debootstrap root file system is also cached as a tarball, so a
wiped engine re-imports it in seconds.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvfabric.containers.engine import DockerEngine
from kvfabric.containers.progress import run_step
from kvfabric.localcluster.versions import cache_root

DIGEST_LABEL = "io.kvfabric.inputs"
SUITE = "bookworm"
MIRROR = os.environ.get("KVFABRIC_DEBIAN_MIRROR", "http://deb.debian.org/debian")
# Runtime libraries of CPython's extension modules (_ssl, _ctypes, _sqlite3, _bz2, _lzma, readline,
# _curses, _uuid, pyexpat, _dbm) and what python:3.12-slim itself carries (CA certificates, netbase,
# tzdata).
PACKAGES = (
    "ca-certificates",
    "netbase",
    "tzdata",
    "libssl3",
    "libffi8",
    "libsqlite3-0",
    "libbz2-1.0",
    "liblzma5",
    "zlib1g",
    "libreadline8",
    "libncursesw6",
    "libuuid1",
    "libexpat1",
    "libgdbm6",
)
DEBIAN_IMAGE = "kvfabric-local/debian:bookworm"
PYTHON_IMAGE = "python:3.12-slim-bookworm"
BUSYBOX_IMAGE = "busybox:1.37.0"
HOST_CA_BUNDLE = Path(os.environ.get("KVFABRIC_CA_BUNDLE", "/etc/ssl/certs/ca-certificates.crt"))
BUSYBOX_BINARY = Path("/bin/busybox")
# Parts of the CPython tree an image does not need (tests alone are 127 MB).
CPYTHON_SKIP = ("test", "idlelib", "tkinter", "turtledemo", "site-packages", "__pycache__")


_PER_PACKAGE = re.compile(r"^I: (Retrieving|Validating|Extracting|Unpacking|Configuring) \S+\.\.\.$")


class BaseImageError(RuntimeError):
    """A base image could not be made; the message names the missing input."""


@dataclass(frozen=True)
class CPython:
    """A CPython 3.12 installation on this machine that the stand-in copies."""

    prefix: Path
    version: str


def find_cpython(minor: str = "3.12") -> CPython:
    """A relocatable CPython ``minor`` here: ``$KVFABRIC_CPYTHON_PREFIX``, else a pyenv version.

    python-build-standalone (what ``uv python install`` fetches) lives on GitHub, which is not
    reachable here, and Debian bookworm packages only 3.11; the machines this CI runs on carry pyenv
    builds of every CPython minor, linked against bookworm's own libraries, which is what the
    bookworm base image provides.
    """
    candidates: list[str] = []
    env = os.environ.get("KVFABRIC_CPYTHON_PREFIX")
    if env:
        candidates.append(env)
    pyenv_root = os.environ.get("PYENV_ROOT", str(Path.home() / ".pyenv"))
    candidates += sorted(glob.glob(f"{pyenv_root}/versions/{minor}.*"), reverse=True)
    for c in candidates:
        exe = Path(c) / "bin" / f"python{minor}"
        if exe.is_file():
            out = subprocess.run(
                [str(exe), "-c", "import platform; print(platform.python_version())"],
                capture_output=True,
                text=True,
                check=False,
            )
            if out.returncode == 0 and out.stdout.strip().startswith(minor + "."):
                return CPython(Path(c), out.stdout.strip())
    raise BaseImageError(
        f"no CPython {minor} found to build the {PYTHON_IMAGE} stand-in: set KVFABRIC_CPYTHON_PREFIX "
        f"to an installation prefix built for Debian {SUITE} (e.g. `pyenv install {minor}`)"
    )


def _sha(*parts: bytes) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(hashlib.sha256(p).digest())
    return h.hexdigest()[:16]


def rootfs_digest() -> str:
    """What the debootstrap root file system depends on."""
    return _sha(SUITE.encode(), MIRROR.encode(), json.dumps(PACKAGES).encode(), b"rootfs-v1")


def python_digest(cpython: CPython) -> str:
    """What the Python stand-in depends on: the root fs, the CPython copied, the CA bundle, this file."""
    lib = cpython.prefix / "lib" / "libpython3.12.so.1.0"
    stamp = f"{cpython.prefix}:{cpython.version}:{lib.stat().st_mtime_ns if lib.exists() else 0}"
    return _sha(
        rootfs_digest().encode(),
        stamp.encode(),
        HOST_CA_BUNDLE.read_bytes() if HOST_CA_BUNDLE.is_file() else b"",
        Path(__file__).read_bytes(),
    )


def busybox_digest() -> str:
    """What the busybox stand-in depends on: the busybox-static binary and this file."""
    if not BUSYBOX_BINARY.is_file():
        raise BaseImageError(f"{BUSYBOX_BINARY} missing: install Debian's busybox-static")
    return _sha(BUSYBOX_BINARY.read_bytes(), Path(__file__).read_bytes())


def image_digest(eng: DockerEngine, image: str) -> str | None:
    """The inputs label of a local image, or None when the image is absent."""
    out = eng.docker(
        "image", "inspect", "--format", f'{{{{index .Config.Labels "{DIGEST_LABEL}"}}}}', image, check=False
    )
    return out.stdout.strip() if out.returncode == 0 else None


def _rootfs_tarball() -> Path:
    return cache_root() / "rootfs" / f"debian-{SUITE}-{rootfs_digest()}.tar"


def ensure_rootfs(say: Callable[[str], None]) -> Path:
    """The cached debootstrap tarball, made first when missing (about 2.5 min, mostly downloads)."""
    tarball = _rootfs_tarball()
    if tarball.is_file():
        return tarball
    if shutil.which("debootstrap") is None:
        raise BaseImageError("debootstrap missing: run scripts/bootstrap.sh")
    tarball.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=tarball.parent, prefix="debootstrap-") as tmp:
        root = Path(tmp) / "root"
        run_step(
            "debootstrap",
            [
                "debootstrap",
                "--variant=minbase",
                f"--include={','.join(PACKAGES)}",
                SUITE,
                str(root),
                MIRROR,
            ],
            # One line per package retrieved/unpacked/configured: keep the phase changes only.
            keep_line=lambda line: _PER_PACKAGE.match(line) is None,
        )
        for junk in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for p in (root / junk).glob("*"):
                if p.is_file():
                    p.unlink()
        partial = tarball.with_suffix(".partial")
        subprocess.run(["tar", "-C", str(root), "-cf", str(partial), "."], check=True)
        partial.replace(tarball)
    say(f"root file system cached in {tarball}")
    return tarball


def ensure_debian(eng: DockerEngine, say: Callable[[str], None]) -> None:
    """``kvfabric-local/debian:bookworm`` from the cached root file system."""
    digest = rootfs_digest()
    if image_digest(eng, DEBIAN_IMAGE) == digest:
        say(f"{DEBIAN_IMAGE} is current")
        return
    tarball = ensure_rootfs(say)
    with tarball.open("rb") as f:
        run_step(
            "import debian",
            [
                eng.docker_path,
                "import",
                "--change",
                f"LABEL {DIGEST_LABEL}={digest}",
                "--change",
                'CMD ["bash"]',
                "-",
                DEBIAN_IMAGE,
            ],
            env=eng.env,
            stdin=f,
        )


PYTHON_DOCKERFILE = """\
FROM {debian}
COPY python/ /usr/local/
COPY ca-certificates.crt /etc/ssl/certs/ca-certificates.crt
RUN ldconfig \\
 && ln -sf python3.12 /usr/local/bin/python3 && ln -sf python3.12 /usr/local/bin/python \\
 && python3.12 -m ensurepip --default-pip \\
 && ln -sf pip3 /usr/local/bin/pip \\
 && python -c "import ssl, ctypes, sqlite3, bz2, lzma, zlib, uuid, venv; print(ssl.OPENSSL_VERSION)"
ENV LANG=C.UTF-8 PYTHON_VERSION={version} \\
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt \\
    REQUESTS_CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt
LABEL {label}={digest} io.kvfabric.stand-in="CPython {version} from {prefix} on Debian {suite}"
CMD ["python3"]
"""

BUSYBOX_DOCKERFILE = """\
FROM scratch
COPY busybox /bin/busybox
RUN ["/bin/busybox", "--install", "-s", "/bin"]
LABEL {label}={digest} io.kvfabric.stand-in="Debian busybox-static"
CMD ["sh"]
"""


def ensure_python(eng: DockerEngine, say: Callable[[str], None]) -> None:
    """The ``python:3.12-slim-bookworm`` stand-in."""
    cpython = find_cpython()
    digest = python_digest(cpython)
    if image_digest(eng, PYTHON_IMAGE) == digest:
        say(f"{PYTHON_IMAGE} stand-in is current")
        return
    ensure_debian(eng, say)
    with tempfile.TemporaryDirectory(prefix="kvfabric-python-ctx-") as tmp:
        ctx = Path(tmp)
        shutil.copytree(
            cpython.prefix,
            ctx / "python",
            symlinks=True,
            ignore=lambda _dir, names: [n for n in names if n in CPYTHON_SKIP],
        )
        shutil.copy(HOST_CA_BUNDLE, ctx / "ca-certificates.crt")
        (ctx / "Dockerfile").write_text(
            PYTHON_DOCKERFILE.format(
                debian=DEBIAN_IMAGE,
                version=cpython.version,
                label=DIGEST_LABEL,
                digest=digest,
                prefix=cpython.prefix,
                suite=SUITE,
            )
        )
        run_step(
            "python stand-in",
            [eng.docker_path, "build", "--network=host", "-t", PYTHON_IMAGE, str(ctx)],
            env=eng.env,
        )


def ensure_busybox(eng: DockerEngine, say: Callable[[str], None]) -> None:
    """The ``busybox:1.37.0`` stand-in."""
    digest = busybox_digest()
    if image_digest(eng, BUSYBOX_IMAGE) == digest:
        say(f"{BUSYBOX_IMAGE} stand-in is current")
        return
    with tempfile.TemporaryDirectory(prefix="kvfabric-busybox-ctx-") as tmp:
        ctx = Path(tmp)
        shutil.copy(BUSYBOX_BINARY, ctx / "busybox")
        (ctx / "Dockerfile").write_text(BUSYBOX_DOCKERFILE.format(label=DIGEST_LABEL, digest=digest))
        run_step("busybox stand-in", [eng.docker_path, "build", "-t", BUSYBOX_IMAGE, str(ctx)], env=eng.env)


def ensure_all(eng: DockerEngine, say: Callable[[str], None] | None = None) -> None:
    """Every base image the Dockerfiles name, made or found current."""
    say = say or (lambda msg: print(f"[images] {msg}", file=sys.stderr, flush=True))
    ensure_busybox(eng, say)
    ensure_python(eng, say)
