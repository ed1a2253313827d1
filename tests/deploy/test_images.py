"""The Dockerfiles, read statically (no Docker daemon needed): what they copy exists and is in the build
context, they run as a non-root user, carry a health check, install what the chart runs, and expose the
ports hicache listens on by default."""

from __future__ import annotations

import fnmatch
import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from hicache.config import ServeConfig

REPO = Path(__file__).resolve().parents[2]
DOCKERFILES = {"cpu": REPO / "deploy" / "Dockerfile", "cuda": REPO / "deploy" / "Dockerfile.cuda"}


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    out: list[tuple[str, str]] = []
    text = re.sub(r"\\\n", " ", path.read_text())
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        op, _, rest = line.partition(" ")
        out.append((op.upper(), rest.strip()))
    return out


def final_stage(ins: list[tuple[str, str]]) -> list[tuple[str, str]]:
    last_from = max(i for i, (op, _) in enumerate(ins) if op == "FROM")
    return ins[last_from:]


def context_includes(path: str, dockerignore: Path) -> bool:
    """Whether ``path`` (relative to the repository root) is sent with the build context."""
    included = True
    for raw in dockerignore.read_text().splitlines():
        pat = raw.strip()
        if not pat or pat.startswith("#"):
            continue
        neg = pat.startswith("!")
        pat = pat.lstrip("!").rstrip("/")
        parts = Path(path).parts
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        if any(fnmatch.fnmatch(p, pat) or fnmatch.fnmatch(p, pat.replace("**/", "")) for p in prefixes):
            included = neg
    return included


@pytest.mark.parametrize("kind", sorted(DOCKERFILES))
def test_dockerfile(kind: str) -> None:
    path = DOCKERFILES[kind]
    ins = instructions(path)
    ignore = path.with_name(path.name + ".dockerignore")
    assert ignore.exists()
    for op, args in ins:
        if op == "COPY" and "--from=" not in args:
            *sources, _dest = [a for a in args.split() if not a.startswith("--")]
            for src in sources:
                assert (REPO / src).exists(), f"{path.name}: COPY {src}: not in the repository"
                assert context_includes(src, ignore), f"{path.name}: COPY {src}: excluded by {ignore.name}"
    final = final_stage(ins)
    users = [a for op, a in final if op == "USER"]
    assert users and users[-1].split(":")[0].isdigit() and int(users[-1].split(":")[0]) != 0, "numeric non-root USER"
    (healthcheck,) = [a for op, a in final if op == "HEALTHCHECK"]
    assert healthcheck.endswith('CMD ["hicache-healthcheck"]')
    assert any(op == "COPY" and "deploy/healthcheck.py" in a and "/usr/local/bin/hicache-healthcheck" in a
               for op, a in final)
    assert ("ENTRYPOINT", '["hicache"]') in final
    exposed = {int(p) for op, a in final if op == "EXPOSE" for p in a.split()}
    assert {ServeConfig.port, ServeConfig.metrics_port} <= exposed
    assert not context_includes("tests/conftest.py", ignore) and not context_includes(".git/HEAD", ignore)
    assert not context_includes("hicache/__pycache__/cache.cpython-311.pyc", ignore)


def test_cuda_image_installs_the_gpu_extra() -> None:
    ins = instructions(DOCKERFILES["cuda"])
    base = next(a for op, a in ins if op == "ARG" and a.startswith("CUDA_IMAGE="))
    assert re.fullmatch(r"CUDA_IMAGE=nvidia/cuda:12\.\d+\.\d+-runtime-ubuntu\d+\.\d+", base)
    assert any(op == "RUN" and 'pip install ".[gpu-cuda12]"' in a for op, a in ins)
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(d.startswith("cupy-cuda12x") for d in extras["gpu-cuda12"])  # CUDA 12 CuPy on the CUDA 12 base
    cpu = instructions(DOCKERFILES["cpu"])
    assert any(op == "ARG" and a == "TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" for op, a in cpu)


def test_entrypoint_is_the_console_script() -> None:
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["hicache"] == "hicache.cli:main"


def build_context(dockerfile: Path, dest: Path) -> None:
    """Copy what `docker build -f <dockerfile> .` sends (the .dockerignore allowlist) to ``dest``; links stay links."""
    ignore = dockerfile.with_name(dockerfile.name + ".dockerignore")
    for root, dirs, files in os.walk(REPO):
        rel_root = Path(root).relative_to(REPO)
        for name in [*dirs, *files]:
            rel = rel_root / name
            src = REPO / rel
            if name in dirs and not src.is_symlink():
                continue
            if not context_includes(str(rel), ignore):
                continue
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            if src.is_symlink():
                target.symlink_to(os.readlink(src))
            else:
                shutil.copy2(src, target)
        dirs[:] = [d for d in dirs if not (Path(root) / d).is_symlink() and d != ".git"]


@pytest.mark.parametrize("kind", sorted(DOCKERFILES))
def test_package_builds_from_the_image_context(kind: str, tmp_path: Path) -> None:
    """`pip install .` in the image builds from the copied files only: the wheel must hold every module and
    the CUDA kernel sources (hicache/kernels is a link to the top-level kernels/)."""
    pytest.importorskip("setuptools")
    pytest.importorskip("wheel")
    ctx = tmp_path / "ctx"
    build_context(DOCKERFILES[kind], ctx)
    src = tmp_path / "src"  # the build stage's WORKDIR after its COPY lines
    src.mkdir()
    for op, args in instructions(DOCKERFILES[kind]):
        if op != "COPY" or "--from=" in args:
            continue
        *sources, dest = [t for t in args.split() if not t.startswith("--")]
        if dest.startswith("/"):  # into the final image, not the build
            continue
        for name in sources:
            p = ctx / name
            assert p.exists(), f"COPY {name}: missing from the build context"
            target = src / dest / p.name if dest.endswith("/") else src / dest
            if p.is_dir():
                shutil.copytree(p, target, symlinks=True)
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(p, target)
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                          "--no-index", "-w", str(tmp_path / "dist"), str(src)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    (whl,) = (tmp_path / "dist").glob("hicache-*.whl")
    names = set(zipfile.ZipFile(whl).namelist())
    want = {str(p.relative_to(REPO)) for p in (REPO / "hicache").rglob("*.py") if "__pycache__" not in p.parts}
    assert want <= names, sorted(want - names)[:5]
    kernels = {f"hicache/kernels/{p.name}" for p in (REPO / "kernels").glob("*.cu")}
    assert kernels and kernels <= names
    assert "hicache/py.typed" in names
