"""The Dockerfiles, read statically (no Docker daemon needed): what they copy exists and is in the build
context, they run as a non-root user, carry a health check, install what the chart runs, and expose the
ports hicache listens on by default."""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
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
    # the root .dockerignore (for builders that read only that one) allows the same files
    assert patterns(REPO / ".dockerignore") == patterns(ignore)


def patterns(dockerignore: Path) -> list[str]:
    return [ln.strip() for ln in dockerignore.read_text().splitlines() if ln.strip() and not ln.startswith("#")]


def test_cuda_image_installs_the_gpu_extra() -> None:
    ins = instructions(DOCKERFILES["cuda"])
    base = next(a for op, a in ins if op == "ARG" and a.startswith("CUDA_IMAGE="))
    assert re.fullmatch(r"CUDA_IMAGE=nvidia/cuda:12\.\d+\.\d+-runtime-ubuntu\d+\.\d+", base)
    # GPU_EXTRA=auto: gpu-cuda12 for a CUDA 12 torch (the cu128 index's), gpu for a CUDA 13 one
    assert ("ARG", "GPU_EXTRA=auto") in ins
    assert any(op == "RUN" and "extra=gpu-cuda12" in a and 'pip install -c /opt/constraints.txt ".[${extra}]"' in a
               for op, a in ins)
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(d.startswith("cupy-cuda12x") for d in extras["gpu-cuda12"])  # CUDA 12 CuPy on the CUDA 12 base
    assert any(d.startswith("cupy-cuda13x") for d in extras["gpu"])
    cpu = instructions(DOCKERFILES["cpu"])
    assert any(op == "ARG" and a == "TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" for op, a in cpu)


def test_cpu_image_pins_the_cpu_torch() -> None:
    """The CPU image installs torch's `+cpu` build, at a version pyproject.toml's torch range admits, and the
    project under a constraint holding it there."""
    from packaging.requirements import Requirement
    from packaging.version import Version

    ins = instructions(DOCKERFILES["cpu"])
    (pin,) = [a.split("=", 1)[1] for op, a in ins if op == "ARG" and a.startswith("TORCH_VERSION=")]
    assert pin.endswith("+cpu")
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    (torch_req,) = [Requirement(d) for d in deps if Requirement(d).name == "torch"]
    assert torch_req.specifier.contains(Version(pin)), (pin, str(torch_req))
    runs = [a for op, a in ins if op == "RUN"]
    assert any('pip install -c /opt/constraints.txt "torch==${TORCH_VERSION}"' in a for a in runs)
    assert any("pip install -c /opt/constraints.txt ." in a and "nvidia-" in a for a in runs)


def test_entrypoint_is_the_console_script() -> None:
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["hicache"] == "hicache.cli:main"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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


# ---- the images built and run (podman; HICACHE_IMAGE_TESTS=1) -----------------------------------------------------
# deploy/build-images.sh builds the CPU image (about 5 min from a cold cache here: beyond what CI's budget has
# room for, so the normal run leaves it out). The image then runs `hicache bench`, and `hicache serve` in a
# detached container: its HEALTHCHECK must pass (`podman healthcheck run`, and the script run with `podman exec`),
# and a gRPC Match / Allocate / Commit / Match from the host must reach it through the published port.

PODMAN = shutil.which("podman")
IMAGE_TESTS = os.environ.get("HICACHE_IMAGE_TESTS") == "1"
CPU_IMAGE_MAX_BYTES = 1_500_000_000
CUDA_DISTS = ("nvidia-", "cuda-", "cupy", "triton")
LIMITS = ("--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024")
image_test = pytest.mark.skipif(not IMAGE_TESTS, reason="builds a container image (minutes): HICACHE_IMAGE_TESTS=1")
needs_podman = pytest.mark.skipif(PODMAN is None, reason="podman not installed")


def podman(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
    assert PODMAN is not None
    cmd = [PODMAN, *(["--runtime", "runc"] if shutil.which("runc") else []), *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if check:
        assert out.returncode == 0, f"{' '.join(cmd)}: {out.returncode}\n{out.stdout}\n{out.stderr}"
    return out


def test_build_script_tags_are_the_charts_image() -> None:
    """What deploy/build-images.sh builds is what the chart's defaults name: values.yaml's image.repository at
    Chart.yaml's appVersion (CPU image), and -cuda after it (CUDA image). Read from the files, no helm needed."""
    import yaml

    chart = REPO / "deploy" / "helm" / "hicache"
    image = yaml.safe_load((chart / "values.yaml").read_text())["image"]
    app_version = yaml.safe_load((chart / "Chart.yaml").read_text())["appVersion"]
    assert image["tag"] == "", "an empty tag: appVersion (CPU) and appVersion-cuda (GPU nodes)"
    out = subprocess.run(["bash", str(REPO / "deploy" / "build-images.sh"), "--cpu", "--cuda", "--print-tags"],
                         capture_output=True, text=True, timeout=30, check=True)
    assert out.stdout.split() == [f"{image['repository']}:{app_version}", f"{image['repository']}:{app_version}-cuda"]
    # --repository / --tag rename both
    out = subprocess.run(["bash", str(REPO / "deploy" / "build-images.sh"), "--cuda", "--print-tags",
                          "--repository", "registry.example/hc", "--tag", "9.9"],
                         capture_output=True, text=True, timeout=30, check=True)
    assert out.stdout.split() == ["registry.example/hc:9.9-cuda"]


def test_build_script_writes_no_index_host() -> None:
    """The package index reaches the build only as build arguments read from the builder's pip settings."""
    script = (REPO / "deploy" / "build-images.sh").read_text()
    for name in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_CERT"):
        assert f"pip_arg {name} " in script or f'"{name}=' in script, name
    for dockerfile in DOCKERFILES.values():
        ins = instructions(dockerfile)
        assert ("ARG", "PIP_INDEX_URL") in ins and ("ARG", "PIP_EXTRA_INDEX_URL") in ins
        final = final_stage(ins)
        assert not any("PIP_INDEX_URL" in a or "PIP_EXTRA_INDEX_URL" in a for _, a in final), dockerfile.name


def test_build_script_names_what_the_chart_runs() -> None:
    """The script's tags are the chart's image references: CPU for the router and CPU nodes, -cuda for GPU nodes."""
    helm_render = pytest.importorskip("helm_render")
    pytest.importorskip("helm_python")
    out = subprocess.run(["bash", str(REPO / "deploy" / "build-images.sh"), "--cpu", "--cuda", "--print-tags"],
                         capture_output=True, text=True, timeout=30, check=True)
    cpu, cuda = out.stdout.split()
    for gpu, node_image in ((True, cuda), (False, cpu)):
        values = {"node": {"gpu": {"enabled": gpu}}, "config": {"cache": {"l1_tokens": 4096, "l2_tokens": 4096}}}
        rel = helm_render.render(values)
        assert helm_render.container(rel.component("node"))["image"] == node_image
        assert helm_render.container(rel.component("router"))["image"] == cpu


@pytest.fixture(scope="module")
def cpu_image() -> str:
    t0 = time.monotonic()
    out = subprocess.run(["bash", str(REPO / "deploy" / "build-images.sh"), "--cpu"], capture_output=True,
                         text=True, timeout=1800)
    took = time.monotonic() - t0
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    m = re.search(r"^built (\S+): (\d+) s, (\d+) bytes", out.stdout, re.M)
    assert m, out.stdout
    image, size = m.group(1), int(m.group(3))
    print(f"\nCPU image {image}: built in {took:.0f} s (script and build), {size / 1e9:.2f} GB")
    return image


@pytest.mark.slow
@pytest.mark.images
@image_test
@needs_podman
def test_cpu_image(cpu_image: str, tmp_path: Path) -> None:
    import numpy as np

    from hicache.client import HiCacheClient

    # size, the health check kept (Docker format), no CUDA wheel whatever index the build reached
    size = int(podman("image", "inspect", "--format", "{{.Size}}", cpu_image).stdout)
    assert size < CPU_IMAGE_MAX_BYTES, f"{cpu_image}: {size / 1e9:.2f} GB"
    health = podman("image", "inspect", "--format", "{{json .Config.Healthcheck}}", cpu_image).stdout
    assert "hicache-healthcheck" in health, health
    dists = podman("run", "--rm", *LIMITS, "--entrypoint", "python", cpu_image, "-c",
                   "import importlib.metadata as md, torch; print(torch.__version__, torch.version.cuda);"
                   "print(*sorted({(d.metadata['Name'] or '').lower() for d in md.distributions()}))").stdout
    torch_line, names = dists.splitlines()
    assert torch_line.endswith("+cpu None"), torch_line
    assert not [n for n in names.split() if n.startswith(CUDA_DISTS)], names
    assert "hicache" in names.split()

    # hicache bench in the image
    out_dir = tmp_path / "bench"
    out_dir.mkdir()
    out_dir.chmod(0o777)  # the image runs as uid 10001
    t0 = time.monotonic()
    bench = podman("run", "--rm", *LIMITS, "-v", f"{out_dir}:/out", cpu_image, "bench", "--requests", "200",
                   "--out", "/out", timeout=600)
    print(f"\nhicache bench --requests 200 in the image: {time.monotonic() - t0:.1f} s\n{bench.stdout[-2500:]}")
    result = json.loads((out_dir / "result.json").read_text())
    assert result, result

    # hicache serve, detached: the container's health check, then gRPC from the host through the published port
    port = free_port()
    name = f"hicache-image-test-{os.getpid()}"
    # /dev/shm: the shared L1 pool lives there (a container gets 64 MiB; serve sizes L1 to at most 2 GiB here)
    podman("run", "-d", "--name", name, *LIMITS, "--shm-size", "3g", "-p", f"127.0.0.1:{port}:50051", cpu_image)
    try:
        t0 = time.monotonic()
        while True:
            hc = podman("healthcheck", "run", name, check=False)
            if hc.returncode == 0:
                break
            state = podman("inspect", "--format", "{{.State.Status}}", name).stdout.strip()
            assert state == "running" and time.monotonic() - t0 < 90, (state, podman("logs", name).stderr[-3000:])
            time.sleep(1)
        print(f"healthy after {time.monotonic() - t0:.1f} s (podman healthcheck run: {hc.stdout.strip() or 'healthy'})")
        ex = podman("exec", name, "hicache-healthcheck")
        print(f"podman exec {name} hicache-healthcheck: {ex.stdout.strip()}")
        assert "SERVING" in ex.stdout
        ex = podman("exec", name, "hicache-healthcheck", "--service", "hicache.v1.HiCache")
        assert "SERVING" in ex.stdout, ex.stdout

        page = 64
        tokens = np.random.default_rng(0).integers(0, 30_000, 8 * page).astype(np.uint32)
        with HiCacheClient(f"127.0.0.1:{port}", timeout_s=10) as client:
            client.wait_ready(timeout_s=30)
            m = client.match(tokens, "r0")
            assert m.num_pages == 8 and m.l1_pages == 0, m
            new = client.allocate("r0", m.num_pages - m.l1_pages)
            committed = client.commit("r0", tokens, np.concatenate([m.device_indices, new])).new_pages
            client.release("r0")
            again = client.match(tokens, "r1")
            client.release("r1")
        print(f"gRPC from the host: Match {m.num_pages} pages, {m.l1_pages} cached; committed {committed}; "
              f"Match again: {again.l1_pages} of {again.num_pages} in L1")
        assert committed == 8 and again.l1_pages == 8
    finally:
        logs = podman("logs", name, check=False)
        podman("rm", "-f", "-t", "5", name, check=False)
    print(f"serve log (tail):\n{(logs.stdout + logs.stderr)[-1500:]}")
