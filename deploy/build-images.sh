#!/usr/bin/env bash
# Build hicache's container images with podman (or docker), tagged the way the Helm chart names them:
#   REPOSITORY:<appVersion>        CPU image   (deploy/Dockerfile)
#   REPOSITORY:<appVersion>-cuda   CUDA image  (deploy/Dockerfile.cuda)
#
#   deploy/build-images.sh [--cpu] [--cuda] [--repository R] [--tag T] [--base IMAGE] [--cuda-base IMAGE]
#                          [--no-stand-in] [--pull-timeout S] [--print-tags] [-- EXTRA BUILD ARGS]
#
# --cpu / --cuda pick the images (default: --cpu). --repository (default: the chart's image.repository in
# deploy/helm/hicache/values.yaml) and --tag (default: the chart's appVersion; the CUDA image gets TAG-cuda)
# name them.
#
# Base images. --base / --cuda-base name one to use as is. Otherwise the public base (python:3.11-slim-bookworm;
# nvidia/cuda:12.8.1-runtime-ubuntu24.04) is used when present or pullable within --pull-timeout (default 60 s),
# and where it is not, a stand-in made with debootstrap (root only) is, imported as
# localhost/hicache-base:python3.11-bookworm: Debian bookworm minbase with Debian's python3, python3-venv and
# ca-certificates. The CUDA image takes the same stand-in: it then has no CUDA libraries of its own, and runs
# on those of the torch and CuPy wheels (a CUDA 13 torch from PyPI brings NVRTC and the runtime as wheels; a
# CUDA 12 torch from the cu128 index needs NVIDIA's base). A stand-in is reused once made; --no-stand-in
# fails instead.
#
# Package index. The build stage's pip uses the builder's own pip settings, read here at build time and passed
# as build arguments (PIP_INDEX_URL, PIP_EXTRA_INDEX_URL, PIP_FIND_LINKS, PIP_TRUSTED_HOST, PIP_CERT,
# PIP_DEFAULT_TIMEOUT): PIP_* in the environment first, else `pip config list`. Local indexes, wheel folders
# (file:// or paths) and the CA bundle are bind-mounted read-only into the build (podman only; docker builds
# drop them). None of it is written into the repository or reaches the final image. TORCH_INDEX_URL (the
# PyTorch wheel index) is passed only when it answers; the CPU torch is pinned to its `+cpu` build either way.
#
# After each build: the image's size and the build time, and a check that the CPU image holds no CUDA wheel.
# Environment: CONTAINER_ENGINE (podman | docker; default podman if installed), CONTAINER_RUNTIME (podman's
# OCI runtime; default runc when installed: crun fails on hybrid cgroup hosts), PYTHON (for pip config).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"

die() { echo "build-images: $*" >&2; exit 1; }
note() { echo "build-images: $*" >&2; }

want_cpu=0 want_cuda=0 print_tags=0 stand_in=1 pull_timeout=60
# The chart's names: image.repository from values.yaml, appVersion from Chart.yaml (its default tag).
repository=$(awk '/^image:/ { in_image = 1; next } /^[^ #]/ { in_image = 0 }
                  in_image && $1 == "repository:" { gsub(/"/, "", $2); print $2; exit }' deploy/helm/hicache/values.yaml)
tag=$(sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\} *$/\1/p' deploy/helm/hicache/Chart.yaml)
cpu_base="" cuda_base=""
extra=()
while (($#)); do
  case $1 in
    --cpu) want_cpu=1 ;;
    --cuda) want_cuda=1 ;;
    --repository) repository=$2; shift ;;
    --tag) tag=$2; shift ;;
    --base) cpu_base=$2; shift ;;
    --cuda-base) cuda_base=$2; shift ;;
    --no-stand-in) stand_in=0 ;;
    --pull-timeout) pull_timeout=$2; shift ;;
    --print-tags) print_tags=1 ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
    --) shift; extra=("$@"); break ;;
    *) die "unknown argument: $1 (see --help)" ;;
  esac
  shift
done
((want_cpu || want_cuda)) || want_cpu=1
[[ -n $repository ]] || die "no repository: image.repository missing from deploy/helm/hicache/values.yaml"
[[ -n $tag ]] || die "no tag: appVersion missing from deploy/helm/hicache/Chart.yaml"
cpu_image="$repository:$tag"
cuda_image="$repository:$tag-cuda"
if ((print_tags)); then
  ((want_cpu)) && echo "$cpu_image"
  ((want_cuda)) && echo "$cuda_image"
  exit 0
fi

engine=${CONTAINER_ENGINE:-}
if [[ -z $engine ]]; then
  if command -v podman >/dev/null; then engine=podman; elif command -v docker >/dev/null; then engine=docker; else
    die "neither podman nor docker is installed"; fi
fi
eng=("$engine")
if [[ $engine == podman ]]; then
  runtime=${CONTAINER_RUNTIME:-}
  [[ -z $runtime ]] && command -v runc >/dev/null && runtime=runc
  [[ -n $runtime ]] && eng+=(--runtime "$runtime")
fi
PY=${PYTHON:-$(command -v python3 || command -v python || true)}

# ---- the builder's pip settings -> build arguments and read-only mounts --------------------------------------
pip_setting() {  # $1: pip option name (index-url); PIP_INDEX_URL in the environment wins, else pip config's last
  local env
  env="PIP_$(tr 'a-z-' 'A-Z_' <<<"$1")"
  if [[ -n ${!env:-} ]]; then printf '%s' "${!env}"; return; fi
  [[ -n $PY ]] || return 0
  "$PY" -m pip config list 2>/dev/null | sed -n "s/^[a-z]*\.$1='\(.*\)'\$/\1/p" | tail -n1
}
build_args=() mounts=() n_mount=0 mapped=""
mount_ro() {  # $1: host path -> $mapped: the path it has inside the build
  mapped="/run/hicache-pip/$n_mount"
  n_mount=$((n_mount + 1))
  mounts+=(-v "$1:$mapped:ro")
}
local_path() { case $1 in file://*) printf '%s' "${1#file://}" ;; /*) printf '%s' "$1" ;; *) return 1 ;; esac; }
pip_arg() {  # $1: build argument  $2: index | links | plain  $3: pip option -> --build-arg, local places mounted
  local value out=() u p
  value=$(pip_setting "$3")
  [[ -n $value ]] || return 0
  if [[ $2 == plain ]]; then build_args+=(--build-arg "$1=$value"); return; fi
  for u in $value; do
    if ! p=$(local_path "$u"); then out+=("$u"); continue; fi
    if [[ ! -e $p ]]; then note "pip $3 $u: not on this machine, left out"; continue; fi
    if [[ $engine != podman ]]; then note "pip $3 $u: local, and $engine build cannot mount it: left out"; continue; fi
    if [[ $2 == index ]]; then  # an index's pages link up to files beside it (../../files): mount its parent
      mount_ro "$(dirname "$p")"
      out+=("file://$mapped/$(basename "$p")")
    else
      mount_ro "$p"
      out+=("$mapped")
    fi
  done
  ((${#out[@]})) && build_args+=(--build-arg "$1=${out[*]}")
  return 0
}
pip_arg PIP_INDEX_URL index index-url
pip_arg PIP_EXTRA_INDEX_URL index extra-index-url
pip_arg PIP_FIND_LINKS links find-links
pip_arg PIP_TRUSTED_HOST plain trusted-host
pip_arg PIP_DEFAULT_TIMEOUT plain default-timeout
cert=$(pip_setting cert)
if [[ -n $cert && -f $cert ]]; then
  if [[ $engine == podman ]]; then mount_ro "$cert"; build_args+=(--build-arg "PIP_CERT=$mapped"); else
    note "pip cert $cert: $engine build cannot mount it: left out"; fi
fi

reachable() {  # $1: URL answers within 8 s
  [[ -n $PY ]] || return 1
  "$PY" - "$1" <<'EOF' >/dev/null 2>&1
import sys, urllib.request
urllib.request.urlopen(sys.argv[1], timeout=8).close()
EOF
}
torch_index_arg() {  # $1: the Dockerfile's default torch index; TORCH_INDEX_URL in the environment overrides it
  local url=${TORCH_INDEX_URL-$1}
  if [[ -n $url ]] && ! reachable "$url/torch/"; then
    note "torch index $url does not answer: torch comes from the pip index above"
    url=""
  fi
  printf '%s' "$url"
}

# ---- base images ----------------------------------------------------------------------------------------------
image_exists() { "${eng[@]}" image inspect "$1" >/dev/null 2>&1; }
make_stand_in() {  # $1: image name  $2: suite  $3: mirror  $4: packages (comma-separated)
  ((stand_in)) || die "base image not available and --no-stand-in given"
  ((EUID == 0)) || die "no base image: making a stand-in needs root (or pass --base/--cuda-base)"
  command -v debootstrap >/dev/null || die "no base image: install debootstrap to make a stand-in (or pass --base)"
  local dir
  dir=$(mktemp -d /tmp/hicache-base.XXXXXX)
  # shellcheck disable=SC2064
  trap "rm -rf '$dir'" EXIT
  note "making stand-in base $1 ($2 minbase + $4) with debootstrap"
  debootstrap --variant=minbase --include="$4" "$2" "$dir" "$3" >&2 || die "debootstrap $2 failed"
  chroot "$dir" apt-get clean
  rm -rf "$dir"/var/lib/apt/lists/* "$dir"/var/cache/apt/* "$dir"/usr/share/doc/* "$dir"/usr/share/man/* \
    "$dir"/usr/share/info/* "$dir"/usr/share/locale/* "$dir"/var/log/*.log "$dir"/var/log/apt/*
  tar -C "$dir" -c . | "${eng[@]}" import --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["/bin/bash"]' - "$1" >/dev/null
  rm -rf "$dir"
  trap - EXIT
}
pick_base() {  # $1: given  $2: public name  $3: stand-in name  $4..: make_stand_in arguments -> the base to build on
  local given=$1 public=$2 standin=$3
  shift 3
  if [[ -n $given ]]; then
    image_exists "$given" || timeout "$pull_timeout" "${eng[@]}" pull -q "$given" >&2 || die "base $given: cannot pull"
    printf '%s' "$given"; return
  fi
  if image_exists "$public" || timeout "$pull_timeout" "${eng[@]}" pull -q "$public" >/dev/null 2>&1; then
    printf '%s' "$public"; return
  fi
  note "public base $public cannot be pulled: using the stand-in $standin"
  image_exists "$standin" || make_stand_in "$standin" "$@"
  printf '%s' "$standin"
}

# ---- build ----------------------------------------------------------------------------------------------------
build() {  # $1: Dockerfile  $2: image  $3..: more build arguments
  local file=$1 image=$2 t0 t1 size
  shift 2
  local cmd=("${eng[@]}" build -f "$file" -t "$image" "${build_args[@]}" "$@")
  if [[ $engine == podman ]]; then
    # the Docker format keeps HEALTHCHECK (OCI has none); the base is local or already pulled
    cmd+=(--format docker --pull=never --network host --ignorefile "$file.dockerignore" "${mounts[@]}"
          --ulimit nofile=1024:1024 --ulimit nproc=1024:1024)
  fi
  cmd+=("${extra[@]}" .)
  note "building $image from $file"
  t0=$(date +%s)
  "${cmd[@]}" >&2
  t1=$(date +%s)
  size=$("${eng[@]}" image inspect --format '{{.Size}}' "$image")
  awk -v i="$image" -v t=$((t1 - t0)) -v s="$size" 'BEGIN { printf "built %s: %d s, %s bytes (%.2f GB)\n", i, t, s, s / 1e9 }'
}
run_in() {  # $1: image  $2..: python code and arguments
  local image=$1
  shift
  local r=("${eng[@]}" run --rm --entrypoint python)
  [[ $engine == podman ]] && r=("${eng[@]}" run --rm --ulimit nofile=1024:1024 --ulimit nproc=1024:1024 --entrypoint python)
  "${r[@]}" "$image" -c "$@"
}
NO_CUDA_CHECK="
import importlib.metadata as md, torch
bad = sorted(n for n in {(d.metadata['Name'] or '').lower() for d in md.distributions()}
             if n.startswith(('nvidia-', 'cuda-', 'cupy', 'triton')))
assert not bad, f'CUDA wheels in the CPU image: {bad}'
assert torch.version.cuda is None and torch.__version__.endswith('+cpu'), torch.__version__
print('no CUDA wheel in the image: torch', torch.__version__)
"

stand_in_base=(localhost/hicache-base:python3.11-bookworm bookworm http://deb.debian.org/debian
               python3,python3-venv,python-is-python3,ca-certificates)
if ((want_cpu)); then
  base=$(pick_base "$cpu_base" docker.io/library/python:3.11-slim-bookworm "${stand_in_base[@]}")
  build deploy/Dockerfile "$cpu_image" --build-arg "BASE_IMAGE=$base" \
    --build-arg "TORCH_INDEX_URL=$(torch_index_arg https://download.pytorch.org/whl/cpu)"
  run_in "$cpu_image" "$NO_CUDA_CHECK"
fi
if ((want_cuda)); then
  base=$(pick_base "$cuda_base" docker.io/nvidia/cuda:12.8.1-runtime-ubuntu24.04 "${stand_in_base[@]}")
  build deploy/Dockerfile.cuda "$cuda_image" --build-arg "CUDA_IMAGE=$base" \
    --build-arg "TORCH_INDEX_URL=$(torch_index_arg https://download.pytorch.org/whl/cu128)"
fi
