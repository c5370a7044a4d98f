#!/usr/bin/env bash
# Packs spconv 2.3.8 for CUDA 12.6, the GPU peer the benchmark compares against,
# into OUTDIR so it can travel to a lent GPU machine (which reaches no package
# registry). Called by tools/prepare_gpu_carry.sh; usable alone:
#
#   tools/spconv_bundle.sh .peer
#   (on the GPU machine)  bash .peer/unpack.sh && export PYTHONPATH=$PWD/.peer/site:$PYTHONPATH
#
# The CUDA wheels hold fat binaries of several hundred MB; unpacked into one
# site folder and compressed with xz they come to about 40 MB, under the 64 MiB
# a device call may carry. Wheels are for CPython 3.12 on x86_64 (the lent
# machine's Python; see tools/README.md).
set -euo pipefail
outdir=${1:?usage: tools/spconv_bundle.sh OUTDIR}
mkdir -p "$outdir"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

download() {  # download PACKAGE_SPEC...: binary wheels for the lent machine's platform
  python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --dest "$work/wheels" "$@"
}

# spconv and cumm pinned; their pure-Python helpers pinned where the pins resolve, else the newest
download spconv-cu126==2.3.8 cumm-cu126==0.8.2 pccm==0.4.16 ccimport==0.4.4 pybind11==2.13.6 \
  fire==0.7.0 portalocker==3.1.1 termcolor==2.5.0 2>/dev/null \
  || download spconv-cu126==2.3.8 cumm-cu126==0.8.2 pccm ccimport pybind11 fire portalocker termcolor

mkdir -p "$work/site"
for wheel in "$work"/wheels/*.whl; do
  python3 -m zipfile -e "$wheel" "$work/site"
done
tar -C "$work/site" -cf - . | xz -9 -T2 >"$outdir/spconv_site.tar.xz"

cat >"$outdir/unpack.sh" <<'UNPACK'
#!/usr/bin/env bash
# Unpacks spconv_site.tar.xz into site/ beside this script; put that folder on PYTHONPATH.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$here/site"
xz -dc "$here/spconv_site.tar.xz" | tar -C "$here/site" -xf -
UNPACK
chmod +x "$outdir/unpack.sh"
ls -l "$outdir/spconv_site.tar.xz" "$outdir/unpack.sh"
