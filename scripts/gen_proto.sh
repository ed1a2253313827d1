#!/usr/bin/env bash
# Regenerate hicache/proto_gen/ from proto/ with grpc_tools.protoc. The generated code is committed;
# tests/service/test_proto_sync.py regenerates into a temporary folder and fails when the two disagree.
# Usage: scripts/gen_proto.sh [OUT_DIR]   (default hicache/proto_gen)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-hicache/proto_gen}
mkdir -p "$out"
python3 -m grpc_tools.protoc -Iproto --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" \
    proto/hicache/v1/*.proto
# protoc writes absolute imports from the proto root ("from hicache.v1 import ..."); root them in our package.
sed -i 's/^from hicache\.v1 import/from hicache.proto_gen.hicache.v1 import/' "$out"/hicache/v1/*_pb2*.py*
# The stubs use nothing newer than grpcio 1.64 (registered methods), but grpcio-tools stamps its own
# version as the minimum, which would refuse hosts with a slightly older grpcio: state the real floor.
sed -i "s/^GRPC_GENERATED_VERSION = '.*'/GRPC_GENERATED_VERSION = '1.64.0'/" "$out"/hicache/v1/*_pb2_grpc.py
for d in "$out" "$out/hicache" "$out/hicache/v1"; do
    [ -f "$d/__init__.py" ] || printf '"""Generated from proto/ by scripts/gen_proto.sh; do not edit."""\n' > "$d/__init__.py"
done
