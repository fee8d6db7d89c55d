#!/usr/bin/env bash
# Prints the path of a CPython interpreter of the given minor version (e.g. 3.11).
# Why: pyenv shims only expose the global version's `python3.X`, so a plain lookup of
# `python3.12` fails on machines where 3.12 is installed but not selected.
set -euo pipefail
want="$1"
for cand in "python$want" ; do
  if p=$(command -v "$cand" 2>/dev/null) && "$p" -c 'pass' >/dev/null 2>&1; then
    echo "$p"; exit 0
  fi
done
root=$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")
for p in "$root"/versions/"$want".*/bin/python"$want"; do
  if [ -x "$p" ]; then echo "$p"; exit 0; fi
done
echo "find_python: no Python $want found (tried python$want on PATH and $root/versions/$want.*)" >&2
exit 1
