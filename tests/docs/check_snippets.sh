#!/usr/bin/env bash
# Checks that every ```cpp block in README.md and docs/*.md is one the tests compile and run:
# the line before the block is `<!-- compiled: PATH -->`, PATH (relative to the repository
# root) exists, and the block equals PATH's doc regions, i.e. the lines between
# `// doc:begin` and `// doc:end` (several regions are concatenated in order; a file without
# any is compared whole). Prints each mismatch as a diff (block -> file) and exits non-zero.
# Bash and awk only: CI's minimal Debian root has no python.
#   bash tests/docs/check_snippets.sh [REPO_ROOT]
set -uo pipefail
root=${1:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
status=0
blocks=0

# The doc regions of a file, concatenated; exit 2 on an unbalanced begin/end.
regions() {
  awk '
    /^[ \t]*\/\/ doc:begin([ \t].*)?$/ {
      if (inside) { print FILENAME ":" FNR ": doc:begin inside a region" > "/dev/stderr"; exit 2 }
      inside = 1; found = 1; next
    }
    /^[ \t]*\/\/ doc:end[ \t]*$/ {
      if (!inside) { print FILENAME ":" FNR ": doc:end without doc:begin" > "/dev/stderr"; exit 2 }
      inside = 0; next
    }
    inside { print }
    { all[FNR] = $0 }
    END {
      if (inside) { print FILENAME ": doc:begin without doc:end" > "/dev/stderr"; exit 2 }
      if (!found) for (i = 1; i <= FNR; ++i) print all[i]
    }' "$1"
}

for md in "$root"/README.md "$root"/docs/*.md; do
  rel=${md#"$root"/}
  # One file per block under $tmp, and an index line "block-file<TAB>md:line<TAB>path".
  awk -v dir="$tmp" -v md="$rel" -v first="$blocks" '
    in_block {
      if ($0 ~ /^```[ \t]*$/) { in_block = 0; close(out) } else print > out
      next
    }
    /^```(cpp|c\+\+)[ \t]*$/ {
      in_block = 1; ++n
      out = dir "/block" (first + n) ".txt"
      printf "" > out
      path = ""
      if (prev ~ /^<!-- compiled: [^ ]+ -->[ \t]*$/) {
        path = prev; sub(/^<!-- compiled: /, "", path); sub(/ -->[ \t]*$/, "", path)
      }
      print out "\t" md ":" NR "\t" path >> (dir "/index")
    }
    prev ~ /^<!-- compiled: / && $0 !~ /^```(cpp|c\+\+)[ \t]*$/ {
      print md ":" NR - 1 ": a compiled: marker not followed by a ```cpp block" > "/dev/stderr"
      bad = 1
    }
    { prev = $0 }
    END {
      if (in_block) { print md ": unterminated ```cpp block" > "/dev/stderr"; bad = 1 }
      print first + n > (dir "/count")
      exit bad
    }' "$md" || status=1
  blocks=$(cat "$tmp/count")
done

if [ -f "$tmp/index" ]; then
  while IFS=$'\t' read -r block where path; do
    if [ -z "$path" ]; then
      echo "$where: \`\`\`cpp block without a '<!-- compiled: tests/docs/NAME.cpp -->' line before it" >&2
      status=1
    elif [ ! -f "$root/$path" ]; then
      echo "$where: $path does not exist" >&2
      status=1
    elif ! regions "$root/$path" > "$block.file"; then
      status=1
    elif ! diff -u --label "$where" --label "$path" "$block" "$block.file"; then
      echo "$where: the block differs from $path (diff above: block -> file)" >&2
      status=1
    fi
  done < "$tmp/index"
fi
if [ "$status" -eq 0 ]; then
  echo "docs snippets: all $blocks \`\`\`cpp blocks match their compiled files"
fi
exit "$status"
