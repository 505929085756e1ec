#!/usr/bin/env bash
# Mutation testing of the test suite (run by hand, not in CI: it takes a while).
#
# Copies the working tree (tracked files and untracked ones that git does not
# ignore, as they are on disk, uncommitted changes included) into a scratch
# folder, builds it once (Release, no sanitizers), checks that the suites the
# mutations name pass there, then applies the mutations of tests/mutations.txt
# one at a time: patch one file, rebuild incrementally, run the named suites,
# record the result, restore the file. A mutation is
#   killed        a named suite failed or timed out (the tests caught the bug)
#   survived      every named suite passed (the tests missed it)
#   build-failed  the mutant does not compile (an error in the list, not a kill)
#   error         its text is missing or ambiguous, its file or a suite unknown
#   n/a           it needs a CPU feature this machine lacks ("needs:" in the
#                 list, e.g. amx: code only the hardware runs), so it is not
#                 run; not a failure
# The list file documents its own format. Exit status: 0 when every selected
# mutation was killed, 1 otherwise, 2 when the run could not start (bad
# arguments or list, a failing build or a red baseline); n/a entries count as
# neither.
set -euo pipefail

usage() {
  cat <<'EOF'
usage: tests/mutate.sh [--list] [--only ID[,ID...]] [--keep] [--jobs N]
                       [--timeout S] [--file LIST]
  --list         print the entries and check that each one's text is found
                 exactly once in the working tree (no build); exit 1 if not
  --only IDS     run only these mutations (comma-separated ids)
  --keep         keep the scratch folder (its path is printed at the end)
  --jobs N       parallel build jobs and ctest jobs (default: nproc)
  --timeout S    time limit of one mutation's ctest run (default: 60 s plus
                 4x the baseline time of its suites); also ctest's --timeout
  --file LIST    the mutation list (default: tests/mutations.txt)
Progress goes to stderr, the table and the summary line to stdout.
EOF
}

die() {
  printf 'mutate.sh: %s\n' "$*" >&2
  exit 2
}

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
list_file=$root/tests/mutations.txt
jobs=$(nproc 2>/dev/null || echo 2)
only=""
keep=false
list_only=false
timeout_arg=""

set_option() {
  case $1 in
    only) only=$2 ;;
    jobs) jobs=$2 ;;
    timeout) timeout_arg=$2 ;;
    file) list_file=$2 ;;
  esac
}

while [[ $# -gt 0 ]]; do
  case $1 in
    --list) list_only=true ;;
    --keep) keep=true ;;
    --only | --jobs | --timeout | --file)
      [[ $# -ge 2 ]] || die "$1 needs a value (see --help)"
      set_option "${1#--}" "$2"
      shift
      ;;
    --only=* | --jobs=* | --timeout=* | --file=*)
      name=${1%%=*}
      set_option "${name#--}" "${1#*=}"
      ;;
    -h | --help)
      usage
      exit 0
      ;;
    *)
      usage >&2
      die "unknown argument '$1'"
      ;;
  esac
  shift
done
[[ $jobs =~ ^[1-9][0-9]*$ ]] || die "--jobs '$jobs': expected a positive integer"
[[ -z $timeout_arg || $timeout_arg =~ ^[1-9][0-9]*$ ]] ||
  die "--timeout '$timeout_arg': expected a positive number of seconds"
[[ -f $list_file ]] || die "no mutation list at '$list_file'"
command -v perl >/dev/null || die "perl is needed to apply mutations"

# ---- the list -----------------------------------------------------------------

ids=() files=() finds=() repls=() occs=() suites=() descs=() lines=() needs=()
declare -A seen_id=()
list_errors=0

list_error() {
  printf 'mutate.sh: %s:%s: %s\n' "$list_file" "$1" "$2" >&2
  list_errors=$((list_errors + 1))
}

# Appends the record being read (if any) after checking its fields.
cur_id="" cur_file="" cur_find="" cur_repl="" cur_occ="" cur_suites="" cur_desc="" cur_needs=""
cur_line=0 have_find=false have_repl=false
flush_record() {
  [[ -n $cur_id || $cur_line -gt 0 ]] || return 0
  local ok=true
  if [[ -z $cur_id ]]; then
    list_error "$cur_line" "record without 'id:'"
    ok=false
  elif [[ ! $cur_id =~ ^[A-Za-z0-9._-]+$ ]]; then
    list_error "$cur_line" "id '$cur_id': use letters, digits, '.', '_' and '-' only"
    ok=false
  elif [[ -n ${seen_id[$cur_id]:-} ]]; then
    list_error "$cur_line" "id '$cur_id' is also used at line ${seen_id[$cur_id]}"
    ok=false
  fi
  [[ -n $cur_file ]] || { list_error "$cur_line" "'$cur_id' has no 'file:'"; ok=false; }
  if ! $have_find || [[ -z $cur_find ]]; then
    list_error "$cur_line" "'$cur_id' has no 'find:' text"
    ok=false
  fi
  $have_repl || { list_error "$cur_line" "'$cur_id' has no 'replace:' line"; ok=false; }
  if $have_find && $have_repl && [[ $cur_find == "$cur_repl" ]]; then
    list_error "$cur_line" "'$cur_id': 'replace:' is the same as 'find:'"
    ok=false
  fi
  [[ -n $cur_suites ]] || { list_error "$cur_line" "'$cur_id' has no 'suites:'"; ok=false; }
  [[ -n $cur_desc ]] || { list_error "$cur_line" "'$cur_id' has no 'desc:'"; ok=false; }
  if [[ -n $cur_needs && ! $cur_needs =~ ^(amx|avx512bf16)$ ]]; then
    list_error "$cur_line" "'$cur_id': needs '$cur_needs' is not one of amx, avx512bf16"
    ok=false
  fi
  if [[ -n $cur_occ && ! $cur_occ =~ ^[1-9][0-9]*$ ]]; then
    list_error "$cur_line" "'$cur_id': occurrence '$cur_occ' is not a positive integer"
    ok=false
  fi
  local -a names=()
  read -r -a names <<<"$cur_suites"
  for s in "${names[@]}"; do
    [[ $s =~ ^[A-Za-z0-9_.+-]+$ ]] || { list_error "$cur_line" "'$cur_id': bad suite name '$s'"; ok=false; }
  done
  if $ok; then
    seen_id[$cur_id]=$cur_line
    ids+=("$cur_id") files+=("$cur_file") finds+=("$cur_find") repls+=("$cur_repl")
    occs+=("$cur_occ") suites+=("${names[*]}") descs+=("$cur_desc") lines+=("$cur_line")
    needs+=("$cur_needs")
  fi
  cur_id="" cur_file="" cur_find="" cur_repl="" cur_occ="" cur_suites="" cur_desc="" cur_needs=""
  cur_line=0 have_find=false have_repl=false
}

lineno=0
while IFS= read -r line || [[ -n $line ]]; do
  lineno=$((lineno + 1))
  line=${line%$'\r'}
  [[ $line =~ ^[[:space:]]*(#|$) ]] && continue
  if [[ ! $line =~ ^([a-z]+):(.*)$ ]]; then
    list_error "$lineno" "expected 'key: value' (keys: id file find replace occurrence suites desc needs)"
    continue
  fi
  key=${BASH_REMATCH[1]}
  value=${BASH_REMATCH[2]}
  value=${value# } # one space separates the key from the value; the rest is the value
  if [[ $key == id ]]; then
    flush_record
    cur_line=$lineno
    cur_id=$value
    continue
  fi
  [[ $cur_line -gt 0 ]] || { list_error "$lineno" "'$key:' before the first 'id:'"; continue; }
  case $key in
    file) cur_file=$value ;;
    find) cur_find=$value have_find=true ;;
    replace) cur_repl=$value have_repl=true ;;
    occurrence) cur_occ=$value ;;
    suites) cur_suites=$value ;;
    desc) cur_desc=$value ;;
    needs) cur_needs=$value ;;
    *) list_error "$lineno" "unknown key '$key' (keys: id file find replace occurrence suites desc needs)" ;;
  esac
done <"$list_file"
flush_record
[[ $list_errors -eq 0 ]] || die "$list_errors error(s) in the list $list_file"
[[ ${#ids[@]} -gt 0 ]] || die "no mutations in $list_file"

# ---- selection ----------------------------------------------------------------

sel=()
if [[ -n $only ]]; then
  IFS=',' read -r -a wanted <<<"$only"
  for w in "${wanted[@]}"; do
    [[ -n $w ]] || continue
    found=""
    for i in "${!ids[@]}"; do
      [[ ${ids[$i]} == "$w" ]] && found=$i
    done
    [[ -n $found ]] || die "--only: no mutation with id '$w' in $list_file (see --list)"
    sel+=("$found")
  done
  [[ ${#sel[@]} -gt 0 ]] || die "--only: no ids given"
else
  sel=("${!ids[@]}")
fi

# ---- applying a mutation ------------------------------------------------------

# apply_mutation DIR INDEX MODE: MODE=check only counts, MODE=apply rewrites
# DIR/file. Prints nothing on success, else the reason (and returns 1).
# perl does the work: it reads the text from the environment, so any
# character is literal.
apply_mutation() {
  local i=$2 mode=$3 path=$1/${files[$2]}
  if [[ ! -f $path ]]; then
    echo "file ${files[$i]} does not exist"
    return 1
  fi
  MUT_FIND=${finds[$i]} MUT_REPL=${repls[$i]} MUT_OCC=${occs[$i]} MUT_MODE=$mode \
    perl -e '
      my ($path) = @ARGV;
      my ($find, $repl, $occ, $mode) = @ENV{qw(MUT_FIND MUT_REPL MUT_OCC MUT_MODE)};
      open(my $fh, "<:raw", $path) or do { print "cannot read: $!\n"; exit 1 };
      my $text = do { local $/; <$fh> };
      close($fh);
      my @at;
      for (my $p = index($text, $find); $p >= 0; $p = index($text, $find, $p + length($find))) {
        push @at, $p;
      }
      my $n = scalar @at;
      if ($occ eq "") {
        if ($n != 1) {
          print $n == 0 ? "text not found\n"
                        : "text found $n times: give \"occurrence:\" or a longer text\n";
          exit 1;
        }
        $occ = 1;
      } elsif ($occ > $n) {
        print "occurrence $occ asked, text found $n time" . ($n == 1 ? "" : "s") . "\n";
        exit 1;
      }
      exit 0 if $mode eq "check";
      substr($text, $at[$occ - 1], length($find)) = $repl;
      open($fh, ">:raw", $path) or do { print "cannot write: $!\n"; exit 1 };
      print $fh $text;
      close($fh) or do { print "cannot write: $!\n"; exit 1 };
    ' "$path"
}

if $list_only; then
  bad=0
  for i in "${sel[@]}"; do
    printf '%s  (%s:%s)\n' "${ids[$i]}" "$(basename "$list_file")" "${lines[$i]}"
    printf '  file:     %s%s\n' "${files[$i]}" "${occs[$i]:+  (occurrence ${occs[$i]})}"
    printf '  find:     %s\n  replace:  %s\n' "${finds[$i]}" "${repls[$i]}"
    printf '  suites:   %s\n  desc:     %s\n' "${suites[$i]}" "${descs[$i]}"
    [[ -z ${needs[$i]} ]] || printf '  needs:    %s\n' "${needs[$i]}"
    if why=$(apply_mutation "$root" "$i" check); then
      printf '  status:   ok in the working tree\n'
    else
      printf '  status:   ERROR: %s\n' "$why"
      bad=$((bad + 1))
    fi
  done
  printf '%d entries, %d with errors\n' "${#sel[@]}" "$bad"
  [[ $bad -eq 0 ]] && exit 0
  exit 1
fi

# ---- scratch copy and build ---------------------------------------------------

command -v cmake >/dev/null || die "cmake is needed"
command -v ctest >/dev/null || die "ctest is needed"
git -C "$root" rev-parse --git-dir >/dev/null 2>&1 || die "$root is not a git checkout"

scratch=$(mktemp -d -t stria-mutate.XXXXXX)
# shellcheck disable=SC2317 # called by the trap
cleanup() {
  if $keep; then
    printf 'mutate.sh: scratch folder kept: %s\n' "$scratch" >&2
  else
    rm -rf "$scratch"
  fi
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
src=$scratch/src
logs=$scratch/logs
orig=$scratch/orig
mkdir -p "$src" "$logs" "$orig"

t_start=$SECONDS
say() { printf '%s\n' "$*" >&2; }

say "== copying the working tree into $src"
n_copied=0
while IFS= read -r -d '' f; do
  if [[ -e $root/$f || -L $root/$f ]] && [[ ! -d $root/$f || -L $root/$f ]]; then
    mkdir -p "$src/$(dirname "$f")"
    cp -P "$root/$f" "$src/$f"
    n_copied=$((n_copied + 1))
  fi
done < <(git -C "$root" ls-files -z --cached --others --exclude-standard)
say "   $n_copied files"

# Texts that are missing or ambiguous are reported now, before the build.
declare -A result=() detail=() secs=()
checked=()
for i in "${sel[@]}"; do
  if why=$(apply_mutation "$src" "$i" check); then
    checked+=("$i")
  else
    result[$i]=error detail[$i]=$why secs[$i]=0
    say "ERROR ${ids[$i]} (${files[$i]}, list line ${lines[$i]}): $why"
  fi
done

# A CPU feature an entry needs (its code runs only there): /proc/cpuinfo's
# flags. Entries that need one this machine lacks are not run (n/a).
cpu_has() {
  local flags
  flags=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || true)
  case $1 in
    amx) [[ $flags =~ (^| )amx_bf16( |$) && $flags =~ (^| )amx_tile( |$) &&
      $flags =~ (^| )avx512_bf16( |$) ]] ;;
    avx512bf16) [[ $flags =~ (^| )avx512_bf16( |$) ]] ;;
    *) return 1 ;;
  esac
}
runs_here=()
for i in "${checked[@]}"; do
  if [[ -n ${needs[$i]} ]] && ! cpu_has "${needs[$i]}"; then
    result[$i]=n/a detail[$i]="needs ${needs[$i]}, which this CPU lacks" secs[$i]=0
    say "N/A ${ids[$i]}: needs ${needs[$i]}, which this CPU lacks"
  else
    runs_here+=("$i")
  fi
done
checked=("${runs_here[@]}")

export UCX_HANDLE_ERRORS=none
export STRIA_LOG_LEVEL=error

say "== configuring and building (Release, no sanitizers) with $jobs jobs"
t0=$SECONDS
if ! (cd "$src" && cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DSTRIA_SANITIZE=OFF &&
  cmake --build build -j "$jobs") >"$logs/build-baseline.log" 2>&1; then
  tail -n 30 "$logs/build-baseline.log" >&2
  die "the unmutated tree does not build (log above)"
fi
say "   built in $((SECONDS - t0)) s"

declare -A known_suite=()
while read -r name; do
  known_suite[$name]=1
done < <(cd "$src/build" && ctest -N | sed -n 's/^ *Test *#[0-9]*: *//p')

# ---- the suites each mutation names must exist ------------------------------------

runnable=()
for i in "${checked[@]}"; do
  why=""
  read -r -a names <<<"${suites[$i]}"
  for s in "${names[@]}"; do
    [[ -n ${known_suite[$s]:-} ]] || why="${why:+$why; }unknown ctest suite '$s'"
  done
  if [[ -n $why ]]; then
    result[$i]=error detail[$i]=$why secs[$i]=0
    say "ERROR ${ids[$i]} (${files[$i]}, list line ${lines[$i]}): $why"
  else
    runnable+=("$i")
  fi
done

suite_regex() {
  local r="" s
  for s in "$@"; do
    r="${r:+$r|}$(printf '%s' "$s" | sed 's/[.+]/\\&/g')"
  done
  printf '^(%s)$' "$r"
}

# The suites that failed, from a ctest log: "name (Failed), name (Timeout)".
failed_suites() {
  sed -n '/The following tests FAILED:/,$p' "$1" |
    sed -n 's/^[[:space:]]*[0-9]* - \([^ ]*\) (\(.*\))$/\1 (\2)/p' | paste -sd, - | sed 's/,/, /g'
}

# ---- baseline -----------------------------------------------------------------

declare -A base_secs=()
if [[ ${#runnable[@]} -gt 0 ]]; then
  declare -A union=()
  for i in "${runnable[@]}"; do
    read -r -a names <<<"${suites[$i]}"
    for s in "${names[@]}"; do union[$s]=1; done
  done
  mapfile -t union_list < <(printf '%s\n' "${!union[@]}" | sort)
  say "== baseline: ${union_list[*]}"
  t0=$SECONDS
  if ! (cd "$src/build" && ctest -R "$(suite_regex "${union_list[@]}")" -j "$jobs" \
    --output-on-failure --timeout "${timeout_arg:-900}") >"$logs/baseline.log" 2>&1; then
    tail -n 40 "$logs/baseline.log" >&2
    die "the unmutated tree fails $(failed_suites "$logs/baseline.log"): a red baseline would make every mutant look killed"
  fi
  while read -r name t; do
    base_secs[$name]=${t%.*}
  done < <(sed -n 's/^.*Test *#[0-9]*: \([^ ]*\) \.*  *Passed  *\([0-9.]*\) sec.*$/\1 \2/p' "$logs/baseline.log")
  say "   passed in $((SECONDS - t0)) s"
fi

# ---- the mutations ------------------------------------------------------------

n_run=${#runnable[@]}
k=0
for i in "${runnable[@]}"; do
  k=$((k + 1))
  id=${ids[$i]} file=${files[$i]}
  log=$logs/$id.log
  t0=$SECONDS
  printf '[%d/%d] %s (%s): ' "$k" "$n_run" "$id" "$file" >&2
  mkdir -p "$orig/$(dirname "$file")"
  cp "$src/$file" "$orig/$file"
  if ! why=$(apply_mutation "$src" "$i" apply); then
    result[$i]=error detail[$i]=$why secs[$i]=$((SECONDS - t0))
    say "ERROR: $why"
    continue
  fi
  printf 'build ' >&2
  if ! (cd "$src" && cmake --build build -j "$jobs") >"$log" 2>&1; then
    result[$i]=build-failed
    detail[$i]=$(grep -m1 'error:' "$log" | sed 's/^.*error: *//' | cut -c1-100 || true)
  else
    # The time limit: 60 s plus 4x the baseline time of the suites.
    read -r -a names <<<"${suites[$i]}"
    limit=$timeout_arg
    if [[ -z $limit ]]; then
      limit=60
      for s in "${names[@]}"; do limit=$((limit + 4 * ${base_secs[$s]:-30})); done
    fi
    printf 'test (%s, limit %d s) ' "${suites[$i]}" "$limit" >&2
    regex=$(suite_regex "${names[@]}")
    set +e
    (cd "$src/build" && timeout -k 10 "$limit" ctest -R "$regex" -j "$jobs" \
      --output-on-failure --timeout "$limit") >>"$log" 2>&1
    rc=$?
    set -e
    if [[ $rc -eq 0 ]]; then
      result[$i]=survived detail[$i]=""
    elif [[ $rc -eq 124 || $rc -eq 137 ]]; then
      result[$i]=killed detail[$i]="time limit of $limit s"
    else
      result[$i]=killed detail[$i]=$(failed_suites "$log")
    fi
  fi
  # Restore with a new mtime, so that the next build recompiles the file.
  cp "$orig/$file" "$src/$file"
  touch "$src/$file"
  secs[$i]=$((SECONDS - t0))
  say "${result[$i]^^}${detail[$i]:+ (${detail[$i]})} in ${secs[$i]} s"
done

# ---- report -------------------------------------------------------------------

killed=0 survived=0 errors=0 na=0
fmt='%-24s %-30s %-12s %-30s %7s  %s\n'
echo
# shellcheck disable=SC2059 # the format is ours
printf "$fmt" id file result suites seconds description
for i in "${sel[@]}"; do
  case ${result[$i]} in
    killed) killed=$((killed + 1)) ;;
    survived) survived=$((survived + 1)) ;;
    n/a) na=$((na + 1)) ;;
    *) errors=$((errors + 1)) ;;
  esac
  # shellcheck disable=SC2059 # the format is ours
  printf "$fmt" "${ids[$i]}" "${files[$i]}" "${result[$i]}" \
    "${suites[$i]// /,}" "${secs[$i]}" "${descs[$i]}"
done
for i in "${sel[@]}"; do
  case ${result[$i]} in
    survived) printf 'SURVIVED %s: %s (suites %s passed)\n' "${ids[$i]}" "${descs[$i]}" "${suites[$i]}" ;;
    build-failed) printf 'BUILD-FAILED %s: the mutant does not compile (%s)\n' "${ids[$i]}" "${detail[$i]}" ;;
    error) printf 'ERROR %s: %s (list line %s)\n' "${ids[$i]}" "${detail[$i]}" "${lines[$i]}" ;;
    n/a) printf 'N/A %s: %s\n' "${ids[$i]}" "${detail[$i]}" ;;
  esac
done
printf 'total time: %d s\n' "$((SECONDS - t_start))"
printf 'mutations: %d killed, %d survived, %d errors, %d not applicable on this CPU\n' \
  "$killed" "$survived" "$errors" "$na"
[[ $survived -eq 0 && $errors -eq 0 ]] || exit 1
exit 0
