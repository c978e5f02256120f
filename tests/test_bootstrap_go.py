"""scripts/install-go.sh: a Go older than the builds need (Debian 12's 1.19) fetches the real one.

The script runs for real against a stand-in ``go`` (it logs its calls and answers like Debian's 1.19,
and its ``go mod download`` lays out a toolchain module the way the module cache does: read-only files
without execute bits); the installed toolchain must be the one that runs, with its modes restored.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.process  # runs the script (test level, see kvfabric.testing.levels)

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "install-go.sh"

STUB = textwrap.dedent(
    """\
    #!/bin/bash
    # A stand-in for an old go: logs its calls, answers `env GOVERSION`, lays out a toolchain module.
    echo "GOTOOLCHAIN=$GOTOOLCHAIN $*" >> "$STUB_LOG"
    if [ "$1 $2" = "env GOVERSION" ]; then echo "$STUB_VERSION"; exit 0; fi
    if [ "$1 $2 $3" = "mod download -json" ]; then
      [ "$STUB_DOWNLOAD" = ok ] || { echo "go: $4: reading the proxy: 404 Not Found" >&2; exit 1; }
      dir="$GOMODCACHE/golang.org/toolchain@${4#*@}"
      mkdir -p "$dir/bin" "$dir/pkg/tool/linux_amd64"
      printf '#!/bin/sh\\necho go1.26.8\\n' > "$dir/bin/go"
      printf '#!/bin/sh\\n' > "$dir/bin/gofmt"
      printf '#!/bin/sh\\n' > "$dir/pkg/tool/linux_amd64/compile"
      chmod -R a-w,a-x "$dir"
      chmod a+x "$dir" "$dir/bin" "$dir/pkg" "$dir/pkg/tool" "$dir/pkg/tool/linux_amd64"
      printf '{\\n\\t"Path": "golang.org/toolchain",\\n\\t"Dir": "%s",\\n\\t"Sum": "h1:x="\\n}\\n' "$dir"
      exit 0
    fi
    exit 2
    """
)


def run_script(
    tmp_path: Path, version: str, download: str = "ok"
) -> tuple[subprocess.CompletedProcess[str], str]:
    stub_dir = tmp_path / "old"
    stub_dir.mkdir(exist_ok=True)
    (stub_dir / "go").write_text(STUB)
    (stub_dir / "go").chmod(0o755)
    log = tmp_path / "calls.log"
    log.touch()
    bin_dir = tmp_path / "bin"
    env = {
        "PATH": f"{bin_dir}:{stub_dir}:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "STUB_LOG": str(log),
        "STUB_VERSION": version,
        "STUB_DOWNLOAD": download,
        "KVFABRIC_GO_ROOT": str(tmp_path / "goroot"),
        "KVFABRIC_GO_BIN_DIR": str(bin_dir),
    }
    if os.geteuid() != 0:
        pytest.skip("the script installs as root (or through sudo)")
    proc = subprocess.run(
        ["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    return proc, log.read_text()


def test_debians_go_fetches_the_toolchain_module_and_the_new_go_runs(tmp_path: Path) -> None:
    proc, calls = run_script(tmp_path, "go1.19.8")
    assert proc.returncode == 0, proc.stderr
    assert "the builds need Go >= 1.26" in proc.stderr
    downloads = [line for line in calls.splitlines() if " mod download " in line]
    assert downloads == [
        "GOTOOLCHAIN=local mod download -json golang.org/toolchain@v0.0.1-go1.26.8.linux-"
        + {"x86_64": "amd64", "aarch64": "arm64"}[os.uname().machine]
    ]
    installed = tmp_path / "bin" / "go"
    assert installed.resolve() == tmp_path / "goroot" / "bin" / "go"
    assert subprocess.run([str(installed)], capture_output=True, text=True, check=True).stdout == "go1.26.8\n"
    tool = tmp_path / "goroot" / "pkg" / "tool" / "linux_amd64" / "compile"
    assert tool.stat().st_mode & stat.S_IXUSR
    assert shutil.which("go", path=f"{tmp_path / 'bin'}:{tmp_path / 'old'}") == str(installed)


def test_a_new_enough_go_is_left_alone(tmp_path: Path) -> None:
    proc, calls = run_script(tmp_path, "go1.26.1")
    assert proc.returncode == 0, proc.stderr
    assert calls.splitlines() == ["GOTOOLCHAIN= env GOVERSION"]
    assert not (tmp_path / "goroot").exists()


def test_an_unreachable_proxy_stops_with_what_to_install(tmp_path: Path) -> None:
    proc, _ = run_script(tmp_path, "go1.19.8", download="fail")
    assert proc.returncode == 1
    assert "404 Not Found" in proc.stderr
    assert "Install Go >= 1.26 yourself" in proc.stderr
    assert not (tmp_path / "goroot").exists()


@pytest.mark.parametrize("script", ["install-go.sh", "bootstrap.sh"])
def test_the_bootstrap_scripts_pass_shellcheck(script: str) -> None:
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        pytest.skip("shellcheck is not installed (apt-get install shellcheck)")
    proc = subprocess.run(
        [shellcheck, str(ROOT / "scripts" / script)], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stdout
