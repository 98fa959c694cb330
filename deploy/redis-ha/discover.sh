# Sourced by redis-start.sh and sentinel-start.sh (POSIX sh): sets PRIMARY_HOST / PRIMARY_PORT
# to the primary that a sentinel of $SENTINELS (host:port,…) names for $SERVICE now, or to the
# seed ($REDIS_SEED, host:port) when none answers (the group's first start). $SKIP (host:port)
# is not asked (a sentinel does not ask itself).
PRIMARY_HOST="${REDIS_SEED%:*}"
PRIMARY_PORT="${REDIS_SEED##*:}"
for s in $(printf '%s' "${SENTINELS:-}" | tr ',' ' '); do
  [ "$s" = "${SKIP:-}" ] && continue
  out=$(REDISCLI_AUTH="$PASSWORD" timeout 3 redis-cli -h "${s%:*}" -p "${s##*:}" --raw \
        SENTINEL get-master-addr-by-name "$SERVICE" 2>/dev/null || true)
  host=$(printf '%s\n' "$out" | sed -n 1p)
  port=$(printf '%s\n' "$out" | sed -n 2p)
  case "$port" in
    ''|*[!0-9]*) continue ;;
  esac
  PRIMARY_HOST="$host"
  PRIMARY_PORT="$port"
  break
done
