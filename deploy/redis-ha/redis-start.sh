#!/bin/sh
# A Redis server of remp's Sentinel group (deploy/docker-compose.ha.yml, deploy/redis-ha/ for
# Kubernetes). The password ($REDIS_PASSWORD, else the file $REDIS_PASSWORD_FILE) reaches
# redis-server on stdin, never argv. It replicates the primary the sentinels name now; at the
# group's first start (no sentinel answers) the seed ($REDIS_SEED) is the primary and the
# others replicate it. A former primary that comes back is thus a replica at once (Sentinel
# would also reconfigure it). Settings: REDIS_ANNOUNCE_HOST (this server's address as the
# others reach it; default the hostname), REDIS_PORT (6379), REDIS_BIND ("* -::*"),
# REDIS_DIR (/data), SENTINELS, SERVICE (remp).
set -eu
PASSWORD="${REDIS_PASSWORD:-$(cat "${REDIS_PASSWORD_FILE:?REDIS_PASSWORD or REDIS_PASSWORD_FILE}")}"
PORT="${REDIS_PORT:-6379}"
SELF="${REDIS_ANNOUNCE_HOST:-$(hostname)}"
SERVICE="${SERVICE:-remp}"
: "${REDIS_SEED:?REDIS_SEED (host:port of the first primary)}"
. "$(dirname "$0")/discover.sh"
REPLICAOF=""
if [ "$PRIMARY_HOST:$PRIMARY_PORT" != "$SELF:$PORT" ]; then
  REPLICAOF="replicaof $PRIMARY_HOST $PRIMARY_PORT"
fi
echo "redis-start: $SELF:$PORT ${REPLICAOF:-primary}" >&2
exec redis-server - <<CONF
port $PORT
bind ${REDIS_BIND:-* -::*}
dir ${REDIS_DIR:-/data}
appendonly yes
save 60 1
requirepass "$PASSWORD"
masterauth "$PASSWORD"
replica-announce-ip $SELF
replica-announce-port $PORT
$REPLICAOF
CONF
