#!/usr/bin/env bash
# Create the rendezvous user and a role limited to the rendezvous key prefix,
# then turn on etcd authentication. Safe to run again.
#
#   ETCDCTL_ENDPOINTS=https://127.0.0.1:2379 \
#   ETCDCTL_CACERT=ca.crt ETCDCTL_CERT=client.crt ETCDCTL_KEY=client.key \
#   ETCD_ROOT_PASSWORD=... ETCD_PASSWORD=... deploy/etcd/create-rendezvous-user.sh
#
# Passwords are read from the environment and handed to etcdctl on stdin or
# in its environment, never on a command line (where `ps` would show them).
# ETCD_USERNAME (default elastic-train) and ETCD_KEY_PREFIX (default
# /elastic-train/) must match the trainer's ETCD_USERNAME and
# `--rdzv-conf key_prefix=...`.
set -euo pipefail

: "${ETCDCTL_ENDPOINTS:?set ETCDCTL_ENDPOINTS, e.g. https://127.0.0.1:2379}"
: "${ETCD_ROOT_PASSWORD:?set ETCD_ROOT_PASSWORD}"
: "${ETCD_PASSWORD:?set ETCD_PASSWORD (the rendezvous user password)}"
user=${ETCD_USERNAME:-elastic-train}
prefix=${ETCD_KEY_PREFIX:-/elastic-train/}
role="${user}-rendezvous"
export ETCDCTL_API=3

# Once authentication is on, every request needs the root credentials (before,
# etcdctl ignores them). Only root may read the status once it is on.
auth_enabled=false
status=$(ETCDCTL_USER="root:${ETCD_ROOT_PASSWORD}" etcdctl auth status 2>/dev/null || true)
if [[ $status == *"Authentication Status: true"* ]]; then
    auth_enabled=true
    export ETCDCTL_USER="root:${ETCD_ROOT_PASSWORD}"
fi

has() {  # has KIND NAME: whether the user or role exists
    etcdctl "$1" get "$2" >/dev/null 2>&1
}

if ! has user root; then
    printf '%s\n' "$ETCD_ROOT_PASSWORD" | etcdctl user add root --interactive=false >/dev/null
fi
etcdctl user grant-role root root >/dev/null 2>&1 || true

if has user "$user"; then
    printf '%s\n' "$ETCD_PASSWORD" | etcdctl user passwd "$user" --interactive=false >/dev/null
else
    printf '%s\n' "$ETCD_PASSWORD" | etcdctl user add "$user" --interactive=false >/dev/null
fi
has role "$role" || etcdctl role add "$role" >/dev/null
# The rendezvous state, torchrun's store and their leases all live under the
# prefix; the role can touch nothing else.
etcdctl role grant-permission "$role" readwrite "$prefix" --prefix=true >/dev/null
etcdctl user grant-role "$user" "$role" >/dev/null 2>&1 || true

if [ "$auth_enabled" = false ]; then
    etcdctl auth enable >/dev/null
fi
echo "user ${user}: role ${role} with readwrite on prefix ${prefix}; authentication enabled"
