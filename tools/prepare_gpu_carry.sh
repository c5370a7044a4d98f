#!/usr/bin/env bash
# Builds .peer/ (ignored by git): everything tools/gpu_check.sh needs on a lent GPU
# machine, which reaches no package registry.
#
#   tools/prepare_gpu_carry.sh            # in the repository root; --force rebuilds the spconv bundle
#
#   .peer/spconv_site.tar.xz, unpack.sh   spconv 2.3.8 for CUDA 12.6 and its pure-Python needs
#                                         (tools/spconv_bundle.sh), about 40 MB
#   .peer/wheels/lark-*.whl               pccm imports lark when spconv.pytorch is imported; the
#                                         machine's image does not have it (pure Python, ~0.1 MB)
#
# It ends by checking that the working tree plus .peer stays under the 64 MiB a
# device call may carry.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
peer=$root/.peer
limit_bytes=$((64 * 1024 * 1024))
cd "$root"

git check-ignore -q .peer/ || { echo "error: .peer/ is not ignored by git (add it to .gitignore)" >&2; exit 1; }
mkdir -p "$peer/wheels"
rm -rf "$peer/site"  # an unpacked bundle (unpack.sh) is hundreds of MB: it must not travel

if [ "${1:-}" = "--force" ] || [ ! -s "$peer/spconv_site.tar.xz" ] || [ ! -x "$peer/unpack.sh" ]; then
  bash "$root/tools/spconv_bundle.sh" "$peer"
fi

rm -f "$peer"/wheels/lark-*.whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 -d "$peer/wheels" "lark==1.3.1"

rm -rf "$peer/data"  # the scans travel in the working tree (data/), no copy needed

tree_bytes=$(git ls-files -co --exclude-standard -z | xargs -0 -r stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}')
peer_bytes=$(find "$peer" -type f -printf '%s\n' | awk '{s += $1} END {print s + 0}')
total=$((tree_bytes + peer_bytes))
printf 'working tree %.1f MiB + .peer %.1f MiB = %.1f MiB (limit 64 MiB)\n' \
  "$(echo "$tree_bytes / 1048576" | bc -l)" "$(echo "$peer_bytes / 1048576" | bc -l)" "$(echo "$total / 1048576" | bc -l)"
find "$peer" -maxdepth 2 -type f -printf '  %8s  %p\n' | sort -k2
if [ "$total" -ge "$limit_bytes" ]; then
  echo "error: what would travel is over 64 MiB; remove something from .peer or the tree" >&2
  exit 1
fi
