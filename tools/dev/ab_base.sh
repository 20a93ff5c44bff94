#!/usr/bin/env bash
# Fill .ab/base (untracked; carry it to the device) with REF's versions of the engine, kernel and tool
# files that differ between REF (default main) and the working tree, for device_validate.sh stage 6's
# BASE tree: `bash tools/dev/ab_base.sh [REF]`, then on the device `cp -r . /tmp/base && cp -r
# .ab/base/. /tmp/base/ && BASE=/tmp/base bash tools/dev/device_validate.sh 6`. Tests are left as
# they are (the base tree runs profiles, not tests); a file new since REF is listed, not removed.
set -eu
ref=${1:-main}
rm -rf .ab/base && mkdir -p .ab/base
exclude="$(git rev-parse --git-common-dir)/info/exclude"
grep -qx '.ab/' "$exclude" 2>/dev/null || echo '.ab/' >> "$exclude"
for f in $(git diff --name-only "$ref" -- engine kernels tools server); do
  if git cat-file -e "$ref:$f" 2>/dev/null; then
    mkdir -p ".ab/base/$(dirname "$f")" && git show "$ref:$f" > ".ab/base/$f"
  else
    echo "new since $ref (kept in the base tree): $f"
  fi
done
find .ab/base -type f | sort
