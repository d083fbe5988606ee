# Sourced by scripts/bootstrap, demo, test, image, rig, bench, fuzz and fresh-clone: how
# a set-up step says what it does and how long it took, and a live line for cargo's long
# builds (never minutes of silence). Needs bash 5 ($EPOCHREALTIME).

# Seconds since the epoch, with a fraction.
steps_now() { echo "${EPOCHREALTIME/,/.}"; }

# Whole seconds since a `steps_now` reading.
steps_since() {
  local now=${EPOCHREALTIME/,/.}
  echo $(( ${now%.*} - ${1%.*} ))
}

# A duration in seconds as a reader takes it in: "42 s", "3 min 05 s", "1 h 02 min".
steps_duration() {
  local s=$1
  if [ "$s" -lt 60 ]; then
    printf '%d s' "$s"
  elif [ "$s" -lt 3600 ]; then
    printf '%d min %02d s' $((s / 60)) $((s % 60))
  else
    printf '%d h %02d min' $((s / 3600)) $((s % 3600 / 60))
  fi
}

# How long since a `steps_now` reading, as steps_duration says it; under 10 s with a
# tenth ("0.3 s"), so that a quick step does not read as "0 s".
steps_took() {
  local now=${EPOCHREALTIME/,/.} t0=${1/,/.}
  local ms=$(( (${now%.*} - ${t0%.*}) * 1000 + (10#${now#*.} - 10#${t0#*.}) / 1000 ))
  if [ "$ms" -lt 10000 ]; then
    printf '%d.%d s' $((ms / 1000)) $((ms % 1000 / 100))
  else
    steps_duration $((ms / 1000))
  fi
}

# CPU seconds (user + system) of the main shell's finished children and their waited-for
# descendants: the work a step did, which holds when the machine is shared and the wall
# clock does not. Read from /proc ($$ is the main shell even in a $(...) subshell, where
# `times` would report the subshell's own, empty, children).
steps_children_cpu() {
  local stat f
  stat=$(</proc/$$/stat)
  read -r -a f <<<"${stat##*) }"
  echo $(( (f[13] + f[14]) / $(getconf CLK_TCK) ))
}

# steps_cargo TAG WHAT -- COMMAND...: runs a cargo command with one live line in place
# of cargo's stream of "Compiling" lines: units built of the total, the ones building,
# the time so far. On a terminal the line is redrawn; elsewhere (CI logs, pipes) a line
# is printed every 20 s. Warnings and errors pass through whole. Returns the command's
# status. Progress goes to stderr; the command's stdout is left alone.
steps_cargo() {
  local tag=$1 what=$2
  shift 2
  [ "${1:-}" = -- ] && shift
  # stdout goes straight to fd 3 (the caller's stdout); stderr through the filter.
  # Call it as `steps_cargo ... || fail ...`: under `set -e` a bare call ends the script
  # on a failed build (as it should) before this function returns.
  local status
  { CARGO_TERM_PROGRESS_WHEN=always CARGO_TERM_PROGRESS_WIDTH=160 "$@" 2>&1 1>&3 3>&- \
      | steps_cargo_filter "$tag" "$what"; status=${PIPESTATUS[0]}; } 3>&1
  return "$status"
}

# Reads cargo's stderr (progress bars end in \r, messages in \n) and prints the live
# line. Internal to steps_cargo.
steps_cargo_filter() {
  local tag=$1 what=$2 started=${EPOCHREALTIME/,/.} tty=0 buf="" chunk rc
  local done_units=0 total=0 building="" nested="" last_shown=0 shown=""
  [ -t 2 ] && tty=1
  steps_cargo_show() {
    local s line
    s=$(steps_since "$started")
    if [ "$total" -gt 0 ]; then
      line="[$tag] $what: $done_units/$total crates, $(steps_duration "$s")"
    else
      line="[$tag] $what: $(steps_duration "$s")"
    fi
    [ -n "$building" ] && line="$line; building $building"
    [ -n "$nested" ] && line="$line ($nested)"
    if [ "$tty" -eq 1 ]; then
      local cols=${COLUMNS:-$(tput cols 2>/dev/null || echo 100)}
      printf '\r\033[K%s' "${line:0:$((cols - 1))}" >&2
      shown=1
    elif { [ "$last_shown" -eq 0 ] && [ "$total" -gt 0 ]; } || [ $((s - last_shown)) -ge 20 ]; then
      printf '%s\n' "$line" >&2
      last_shown=$((s > 0 ? s : 1))
    fi
  }
  steps_cargo_line() {
    local l=$1 trimmed
    trimmed="${l#"${l%%[![:space:]]*}"}"
    # What is left of a redrawn bar is blanks; an empty line is the message's own.
    [ -z "$trimmed" ] && [ -n "$l" ] && return
    if [[ $trimmed =~ ^[A-Z][a-z]+\ \[.*\]\ +([0-9]+)/([0-9]+)(:\ (.*))?$ ]]; then
      done_units=${BASH_REMATCH[1]}
      total=${BASH_REMATCH[2]}
      building=${BASH_REMATCH[4]%"${BASH_REMATCH[4]##*[![:space:]]}"}
      # The eBPF objects are built by agent/build.rs: name what that unit is doing.
      [[ $building == *"weir-agent(build)"* ]] || nested=""
      return
    fi
    # Other bars (the index fetch: "Fetch [==>  ] 3 complete; 2 pending").
    [[ $trimmed =~ ^[A-Z][a-z]+\ \[.*\]\  ]] && return
    # A build script's nested cargo (agent/build.rs builds the eBPF objects): progress.
    if [[ $trimmed =~ ^warning:\ [a-z0-9_-]+@[^:]+:\ +(Compiling|Finished|Checking|Locking|Downloaded|Updating)\ (.*)$ ]]; then
      nested="eBPF objects: ${BASH_REMATCH[1]} ${BASH_REMATCH[2]%% (*}"
      return
    fi
    # cargo install's advice about PATH: the tool is linked into .tools/bin.
    [[ $trimmed == "warning: be sure to add"* ]] && return
    # cargo's own status lines are what the live line counts.
    if [[ $trimmed =~ ^(Compiling|Checking|Fresh|Downloaded|Downloading|Locking|Updating|Adding|Blocking|Installing|Installed|Replacing|Replaced|Documenting|Dirty|Finished|Running|Packaging|Ignored)\  ]]; then
      return
    fi
    if [ "$tty" -eq 1 ] && [ -n "$shown" ]; then printf '\r\033[K' >&2; shown=""; fi
    printf '%s\n' "$l" >&2
  }
  steps_cargo_chunk() {
    local c=$1 l
    while [[ $c == *$'\n'* ]]; do
      l=${c%%$'\n'*}
      c=${c#*$'\n'}
      steps_cargo_line "$l"
    done
    steps_cargo_line "$c"
  }
  while :; do
    chunk=""
    IFS= read -r -d $'\r' -t 5 chunk && rc=0 || rc=$?
    if [ "$rc" -gt 128 ]; then
      buf+=$chunk
      steps_cargo_show
      continue
    fi
    steps_cargo_chunk "$buf$chunk"
    buf=""
    [ "$rc" -ne 0 ] && break
    steps_cargo_show
  done
  if [ "$tty" -eq 1 ] && [ -n "$shown" ]; then printf '\r\033[K' >&2; fi
}
