"""Images for the real nodes, which cannot pull from any registry: saved from the harness's engine.

The sandbox image is the static ``pause`` binary of build-kubelet.sh in a ``FROM scratch`` image; the
others are kvfabric's images as ``kvfabric images build`` made them. Each is saved once per image id
into ``<cache>/node-images/`` and imported into every node's containerd when the node starts.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

from kvfabric.containers.base import DIGEST_LABEL, image_digest
from kvfabric.containers.build import images
from kvfabric.containers.engine import DockerEngine
from kvfabric.localcluster.realnodes import PAUSE_IMAGE
from kvfabric.localcluster.versions import cache_root

# The images a real node gets by default (the engine image, several GB, only on request).
DEFAULT_IMAGES = ("cacheserver", "connector", "operator")


def ensure_pause(eng: DockerEngine, pause_binary: Path) -> None:
    """The pause image, rebuilt when the binary changes."""
    import hashlib

    digest = hashlib.sha256(pause_binary.read_bytes()).hexdigest()[:16]
    if image_digest(eng, PAUSE_IMAGE) == digest:
        return
    with tempfile.TemporaryDirectory(prefix="kvfabric-pause-") as tmp:
        ctx = Path(tmp)
        shutil.copy(pause_binary, ctx / "pause")
        (ctx / "Dockerfile").write_text(
            f'FROM scratch\nCOPY pause /pause\nLABEL {DIGEST_LABEL}={digest}\nENTRYPOINT ["/pause"]\n'
        )
        eng.docker("build", "-q", "-t", PAUSE_IMAGE, str(ctx))


def saved(eng: DockerEngine, ref: str) -> Path:
    """``docker save`` of ``ref``, cached by image id."""
    image_id = eng.docker("image", "inspect", "--format", "{{.Id}}", ref).stdout.strip().split(":")[-1]
    out = cache_root() / "node-images" / f"{ref.replace('/', '_').replace(':', '_')}-{image_id[:12]}.tar"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        for old in out.parent.glob(f"{ref.replace('/', '_').replace(':', '_')}-*.tar"):
            old.unlink()
        partial = out.with_suffix(".partial")
        eng.docker("save", "-o", str(partial), ref)
        partial.replace(out)
    return out


def node_images(pause_binary: Path, names: Sequence[str] = DEFAULT_IMAGES) -> list[Path]:
    """Tarballs of the pause image and the named kvfabric images, rebuilt first when out of date."""
    from kvfabric.containers import base, build
    from kvfabric.containers.engine import engine

    chosen = [i for i in images() if i.directory in names]
    with engine() as eng:
        ensure_pause(eng, pause_binary)
        base.ensure_all(eng)
        for image in chosen:  # a digest check each when current; a build when the sources changed
            build.build(eng, image)
        return [saved(eng, PAUSE_IMAGE), *(saved(eng, i.ref) for i in chosen)]
