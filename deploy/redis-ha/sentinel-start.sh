#!/bin/sh
# A sentinel of remp's Redis group (see redis-start.sh). Sentinel rewrites its configuration
# file as it learns the group, so it is written here (0600, $SENTINEL_CONF, default
# /data/sentinel.conf: a private volume) with the primary another sentinel names now, or the
# seed. Settings: SENTINEL_ANNOUNCE_HOST (default the hostname), SENTINEL_PORT (26379),
# SENTINEL_BIND, SENTINELS (every sentinel, host:port,…), REDIS_SEED, SERVICE (remp), QUORUM
# (2), DOWN_AFTER_MS (2000), FAILOVER_TIMEOUT_MS (10000).
set -eu
PASSWORD="${REDIS_PASSWORD:-$(cat "${REDIS_PASSWORD_FILE:?REDIS_PASSWORD or REDIS_PASSWORD_FILE}")}"
PORT="${SENTINEL_PORT:-26379}"
SELF="${SENTINEL_ANNOUNCE_HOST:-$(hostname)}"
SERVICE="${SERVICE:-remp}"
CONF="${SENTINEL_CONF:-/data/sentinel.conf}"
: "${REDIS_SEED:?REDIS_SEED (host:port of the first primary)}"
SKIP="$SELF:$PORT"
. "$(dirname "$0")/discover.sh"
echo "sentinel-start: $SELF:$PORT monitors $SERVICE at $PRIMARY_HOST:$PRIMARY_PORT" >&2
umask 077
cat > "$CONF" <<CONF
port $PORT
bind ${SENTINEL_BIND:-* -::*}
sentinel resolve-hostnames yes
sentinel announce-hostnames yes
sentinel announce-ip $SELF
sentinel announce-port $PORT
requirepass "$PASSWORD"
sentinel sentinel-pass "$PASSWORD"
sentinel monitor $SERVICE $PRIMARY_HOST $PRIMARY_PORT ${QUORUM:-2}
sentinel auth-pass $SERVICE "$PASSWORD"
sentinel down-after-milliseconds $SERVICE ${DOWN_AFTER_MS:-2000}
sentinel failover-timeout $SERVICE ${FAILOVER_TIMEOUT_MS:-10000}
sentinel parallel-syncs $SERVICE 1
CONF
exec redis-server "$CONF" --sentinel
