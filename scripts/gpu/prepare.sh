#!/usr/bin/env bash
# Build the wheelhouse an air-gapped GPU host installs trtspec from (run where a package index is
# reachable; scripts/gpu/README.md): the wheels of scripts/gpu/wheelhouse.txt for CPython 3.12 on
# manylinux x86-64, without their dependencies (the list names every one the host lacks).
#
#   bash scripts/gpu/prepare.sh [WHEELHOUSE]        # default: .wheelhouse in the repository root
#
# Environment: PYTHON (the pip to use, default python3), PYTHON_VERSION (3.12), PLATFORM
# (manylinux_2_28_x86_64). The folder is built beside WHEELHOUSE and then renamed into place, so it
# holds exactly the listed wheels and an interrupted run leaves the previous one.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
wheelhouse="$(realpath -m "${1:-$root/.wheelhouse}")"
python="${PYTHON:-python3}"
version="${PYTHON_VERSION:-3.12}"
platform="${PLATFORM:-manylinux_2_28_x86_64}"
list="$root/scripts/gpu/wheelhouse.txt"

# Replace only a folder of wheels: anything else in it (a subfolder, another file) means it is not ours.
if [[ -e "$wheelhouse" ]] && { [[ ! -d "$wheelhouse" ]] ||
    [[ -n "$(find "$wheelhouse" -mindepth 1 \( ! -type f -o ! -name '*.whl' \) -print -quit)" ]]; }; then
  echo "Error: $wheelhouse exists and is not a folder of wheels; give a new folder or a wheelhouse" >&2
  exit 1
fi
mkdir -p "$(dirname "$wheelhouse")"
staging="$(mktemp -d "$wheelhouse.partial.XXXXXX")"
trap 'rm -rf "$staging"' EXIT

mapfile -t requirements < <(sed -e 's/#.*//' -e 's/[[:space:]]//g' "$list" | grep -v '^$')
for requirement in "${requirements[@]}"; do
  if ! "$python" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
      --python-version "$version" --implementation cp --platform "$platform" -d "$staging" "$requirement"; then
    # Published only as an sdist: build the wheel here (right for pure-Python packages, which these are).
    echo "prepare: no wheel of $requirement for cp${version/./} on $platform; building one from its sdist" >&2
    "$python" -m pip wheel --quiet --disable-pip-version-check --no-deps --no-binary="${requirement%%[=<>!~]*}" \
      -w "$staging" "$requirement"
  fi
done

count="$(find "$staging" -name '*.whl' | wc -l)"
if [[ "$count" -ne "${#requirements[@]}" ]]; then
  echo "Error: expected ${#requirements[@]} wheels from $list, got $count" >&2
  exit 1
fi
if [[ -d "$wheelhouse" ]]; then  # the old wheels, then the folder, which must be empty by now
  find "$wheelhouse" -mindepth 1 -maxdepth 1 -type f -name '*.whl' -delete
  rmdir "$wheelhouse"
fi
mv "$staging" "$wheelhouse"
trap - EXIT
ls -1 "$wheelhouse"
echo "prepare: $count wheels, $(du -sh "$wheelhouse" | cut -f1) in $wheelhouse"
