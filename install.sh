#!/bin/sh
# Builds packd in release mode and installs it under a prefix:
#
#   PREFIX/bin/packd, PREFIX/bin/packctl
#   PREFIX/lib/libpackd_client.so.X.Y.Z (SONAME libpackd_client.so.X.Y for 0.Y releases,
#       .so.X from 1.0), with the .so.X.Y and .so links, and libpackd_client.a
#   PREFIX/lib/libpackd_xnnpack_preload.so        (LD_PRELOAD it: packd as the weights
#       cache of an unmodified engine that exports XNNPACK's C API)
#   PREFIX/lib/libpackd_llama.so                  (LD_PRELOAD it: packd as the host's store
#       of llama.cpp's repacked weights; ggml 0.9.8, 0.15.1 and 0.25.3; packd.llama.enable()
#       finds it here)
#   PREFIX/include/packd.h, PREFIX/include/packd_xnnpack.h
#   PREFIX/lib/pkgconfig/packd-client.pc          (links the shared library)
#   PREFIX/lib/pkgconfig/packd-client-static.pc   (links the archive, whatever else is installed)
#   PREFIX/share/doc/packd/: the README, docs/*.md and the commented packd.toml
#
# The .pc files name the real prefix. For a prefix whose lib directory the dynamic linker
# does not search, packd-client.pc also carries an rpath, so programs linked with it run
# without LD_LIBRARY_PATH; as root, ldconfig is run after installing into a searched one.
set -eu

usage() {
  cat <<EOF
usage: ./install.sh [--prefix DIR] [--destdir DIR] [--no-build]

Builds packd, packctl, libpackd_client, libpackd_xnnpack_preload and libpackd_llama (cargo build
--release --locked) and installs them, the C headers and pkg-config files under DIR.

  --prefix DIR   where to install (default: /usr/local as root, else \$HOME/.local)
  --destdir DIR  stage the files under DIR/PREFIX instead (for packaging; no ldconfig)
  --no-build     install what the last release build left in the target directory
EOF
}

root=$(cd "$(dirname "$0")" && pwd)
if [ "$(id -u)" -eq 0 ]; then prefix=/usr/local; else prefix=${HOME:?set HOME or pass --prefix}/.local; fi
destdir=""
build=1
while [ $# -gt 0 ]; do
  case $1 in
    --prefix) prefix=${2:?--prefix needs a directory}; shift 2 ;;
    --prefix=*) prefix=${1#*=}; shift ;;
    --destdir) destdir=${2:?--destdir needs a directory}; shift 2 ;;
    --destdir=*) destdir=${1#*=}; shift ;;
    --no-build) build=""; shift ;;
    -h | --help) usage; exit 0 ;;
    *) echo "install.sh: unknown argument $1" >&2; usage >&2; exit 64 ;;
  esac
done
case $prefix in
  /*) ;;
  *) echo "install.sh: --prefix must be an absolute path, not $prefix" >&2; exit 64 ;;
esac

version=$(sed -n 's/^version = "\(.*\)"/\1/p' "$root/Cargo.toml" | head -n 1)
major=${version%%.*}
rest=${version#*.}
minor=${rest%%.*}
# A 0.Y release may break its ABI at 0.Y+1, so its SONAME carries both numbers.
if [ "$major" = 0 ]; then sover=$major.$minor; else sover=$major; fi
soname=libpackd_client.so.$sover

target=${CARGO_TARGET_DIR:-$root/target}
case $target in /*) ;; *) target=$root/$target ;; esac
rel=$target/release
if [ -n "$build" ]; then
  cd "$root"
  # The C library gets its SONAME from its own build script (capi/build.rs).
  cargo build --release --locked -p packd -p packctl -p packd-capi -p packd-xnnpack-preload -p packd-llama
fi
for f in packd packctl libpackd_client.so libpackd_client.a libpackd_xnnpack_preload.so libpackd_llama.so; do
  [ -f "$rel/$f" ] || { echo "install.sh: $rel/$f is missing; run without --no-build" >&2; exit 1; }
done
# A library built before the build script set the SONAME (or by another version) would be
# installed under a name its programs do not ask for.
if command -v readelf >/dev/null && ! readelf -d "$rel/libpackd_client.so" | grep -q "soname: \[$soname\]"; then
  echo "install.sh: $rel/libpackd_client.so lacks the SONAME $soname; rebuild (run without --no-build)" >&2
  exit 1
fi
# The build directory gets the SONAME link too, as ldconfig would make it: programs linked
# there (examples/xnnpack/build) run from it.
ln -sf libpackd_client.so "$rel/$soname"

libdir=$prefix/lib
dest() { printf '%s%s' "$destdir" "$1"; }
mkdir -p "$(dest "$prefix/bin")" "$(dest "$libdir/pkgconfig")" "$(dest "$prefix/include")"
install -m755 "$rel/packd" "$rel/packctl" "$(dest "$prefix/bin")/"
install -m755 "$rel/libpackd_client.so" "$(dest "$libdir")/libpackd_client.so.$version"
ln -sf "libpackd_client.so.$version" "$(dest "$libdir")/$soname"
ln -sf "$soname" "$(dest "$libdir")/libpackd_client.so"
install -m644 "$rel/libpackd_client.a" "$(dest "$libdir")/"
install -m755 "$rel/libpackd_xnnpack_preload.so" "$rel/libpackd_llama.so" "$(dest "$libdir")/"
install -m644 "$root/capi/include/packd.h" "$root/capi/include/packd_xnnpack.h" "$(dest "$prefix/include")/"
# The documents the units' Documentation= lines name (file:/usr/share/doc/packd/… for --prefix /usr).
mkdir -p "$(dest "$prefix/share/doc/packd")"
install -m644 "$root/README.md" "$root"/docs/*.md "$root/deploy/packd.toml" "$(dest "$prefix/share/doc/packd")/"

# The dynamic linker searches these (with ldconfig's cache for /usr/local/lib); other lib
# directories get an rpath.
rpath=" -Wl,-rpath,\${libdir}"
case $libdir in
  /usr/lib | /usr/lib64 | /lib | /lib64 | /usr/local/lib) rpath="" ;;
esac
# What the archive needs from the system (rustc --print native-static-libs).
private="-lgcc_s -lutil -lrt -lpthread -lm -ldl -lc"
pc() {
  cat <<EOF
prefix=$prefix
libdir=\${prefix}/lib
includedir=\${prefix}/include

Name: $1
Description: Client of packd: map packed model weights shared by every process on the host
Version: $version
Cflags: -I\${includedir}
EOF
}
{
  pc packd-client
  echo "Libs: -L\${libdir}$rpath -lpackd_client"
  echo "Libs.private: $private"
} >"$(dest "$libdir/pkgconfig/packd-client.pc")"
{
  pc packd-client-static
  echo "Libs: \${libdir}/libpackd_client.a $private"
} >"$(dest "$libdir/pkgconfig/packd-client-static.pc")"

if [ -z "$destdir" ] && [ -z "$rpath" ] && [ "$(id -u)" -eq 0 ] && command -v ldconfig >/dev/null; then
  ldconfig
fi
echo "installed packd $version under $destdir$prefix"
case ":$PATH:" in
  *":$prefix/bin:"*) ;;
  *) echo "note: $prefix/bin is not on PATH; add it: export PATH=\"$prefix/bin:\$PATH\"" ;;
esac
case $libdir in
  /usr/lib | /usr/lib64 | /usr/local/lib) ;;
  *) echo "note: for pkg-config: export PKG_CONFIG_PATH=\"$libdir/pkgconfig\${PKG_CONFIG_PATH:+:\$PKG_CONFIG_PATH}\"" ;;
esac
