#!/usr/bin/env bash
# Functions of deploy/slurm/train.sbatch, sourced by it (and usable by your own
# batch scripts): the job's private directory, the job secret, and an etcd for
# the job alone on the first node, locked down:
#
#   - it listens on the head node's cluster address only (not 0.0.0.0), on a
#     port found free at start, so two jobs on one node never collide;
#   - clients need TLS with a client certificate of the job's own CA
#     (deploy/etcd/make-certs.sh), and etcd authentication is on, with a
#     rendezvous user whose role covers only this job's keys
#     (deploy/etcd/create-rendezvous-user.sh);
#   - the passwords and the job secret are 0600 files in the job directory,
#     handed on in environment variables and files: never on a command line
#     (which `ps` shows to every user) and never printed;
#   - the passwords are 256 random bits, so etcd hashes them at bcrypt's lowest
#     cost (4): every worker logs in again at its first request after five
#     quiet minutes (etcd's --auth-token-ttl), that is at a recovery, and at
#     the default cost (10) each login costs etcd about 66 ms of CPU.
#
# The job directory ($ELASTIC_TRAIN_JOBS_DIR/slurm-$SLURM_JOB_ID, default
# $HOME/.elastic-train/jobs/...) must be on a file system every node of the
# job sees; it is private (0700) and deleted at the end of the job.
#
# The caller sets job_dir=$(et_make_job_dir); et_start_etcd then sets endpoint,
# rdzv_conf, etcd_pid and etcd_dir, and exports ETCD_USERNAME and ETCD_PASSWORD
# for the agents; et_cleanup removes it all.

#: the etcd user of the agents, and the key prefix of every job's rendezvous
ET_USER=elastic-train
ET_KEY_PREFIX=/elastic-train

# Print the job's private directory on the shared file system, made fresh (a
# requeued job keeps its id, and its old directory holds nothing of use):
#   job_dir=$(et_make_job_dir)
et_make_job_dir() {
    local dir=${ELASTIC_TRAIN_JOBS_DIR:-$HOME/.elastic-train/jobs}/slurm-${SLURM_JOB_ID:?}
    if [[ $dir == *,* ]]; then
        echo "job directory $dir contains ',', which --rdzv-conf items are split at" >&2
        return 1
    fi
    rm -rf "$dir"
    (umask 077 && mkdir -p "$dir")
    chmod 0700 "$dir"
    (cd "$dir" && pwd)
}

# et_random_hex FILE: 32 random bytes as 64 hex characters, in a new 0600 file.
et_random_hex() {
    (umask 077 && python -c 'import secrets; print(secrets.token_hex(32))' >"$1")
}

# et_free_port ADDRESS: a TCP port that is free on ADDRESS now.
et_free_port() {
    python -c 'import socket, sys
with socket.socket() as s:
    s.bind((sys.argv[1], 0))
    print(s.getsockname()[1])' "$1"
}

# The address the other nodes reach this (the first) node at:
# ELASTIC_TRAIN_ETCD_HOST, or the first non-loopback IPv4 address of this
# host's name, or of its interfaces.
et_head_address() {
    if [ -n "${ELASTIC_TRAIN_ETCD_HOST:-}" ]; then
        echo "$ELASTIC_TRAIN_ETCD_HOST"
        return 0
    fi
    local addr
    addr=$(getent ahostsv4 "$(hostname)" 2>/dev/null | awk '$1 !~ /^127\./ {print $1; exit}')
    [ -n "$addr" ] || addr=$(hostname -I 2>/dev/null | awk '{print $1}')
    if [ -z "$addr" ]; then
        echo "no cluster address found for $(hostname); set ELASTIC_TRAIN_ETCD_HOST" >&2
        return 1
    fi
    echo "$addr"
}

# etcdctl against this job's etcd, with the job's client certificate.
et_etcdctl() {
    ETCDCTL_API=3 ETCDCTL_ENDPOINTS="https://${endpoint}" ETCDCTL_CACERT="$job_dir/tls/ca.crt" \
        ETCDCTL_CERT="$job_dir/tls/client.crt" ETCDCTL_KEY="$job_dir/tls/client.key" \
        etcdctl "$@"
}

# Wait until the etcd just started answers; fails if it exits first (e.g. its
# port was taken in between) or stays silent for 30 s.
et_wait_for_etcd() {
    local _
    for _ in $(seq 150); do
        kill -0 "$etcd_pid" 2>/dev/null || return 1
        et_etcdctl endpoint health >/dev/null 2>&1 && return 0
        sleep 0.2
    done
    return 1
}

# Start etcd for this job on this node. Sets endpoint (host:port), rdzv_conf
# (TLS files and key prefix for --rdzv-conf), etcd_pid and etcd_dir (its
# node-local data), and exports ETCD_USERNAME/ETCD_PASSWORD for the agents.
et_start_etcd() {
    local addr port peer_port attempt tls=$job_dir/tls
    addr=$(et_head_address)
    etcd_dir=$(mktemp -d "${TMPDIR:-/tmp}/elastic-train-etcd.XXXXXX")
    ETCD_CLIENT_CN=$ET_USER bash deploy/etcd/make-certs.sh "$tls" "$addr" >/dev/null
    for attempt in 1 2 3 4 5; do
        port=${ETCD_PORT:-$(et_free_port "$addr")}
        peer_port=$(et_free_port 127.0.0.1)
        endpoint="${addr}:${port}"
        etcd --name=rendezvous --data-dir="$etcd_dir/data" \
            --listen-client-urls="https://${endpoint}" \
            --advertise-client-urls="https://${endpoint}" \
            --listen-peer-urls="http://127.0.0.1:${peer_port}" \
            --initial-advertise-peer-urls="http://127.0.0.1:${peer_port}" \
            --initial-cluster="rendezvous=http://127.0.0.1:${peer_port}" \
            --client-cert-auth --trusted-ca-file="$tls/ca.crt" \
            --cert-file="$tls/server.crt" --key-file="$tls/server.key" \
            --bcrypt-cost=4 \
            >"$etcd_dir/etcd.log" 2>&1 &
        etcd_pid=$!
        et_wait_for_etcd && break
        kill "$etcd_pid" 2>/dev/null || true
        wait "$etcd_pid" 2>/dev/null || true
        if [ "$attempt" = 5 ]; then
            echo "etcd did not start on ${endpoint}; its log:" >&2
            tail -n 20 "$etcd_dir/etcd.log" >&2
            return 1
        fi
        rm -rf "$etcd_dir/data"
    done
    et_random_hex "$job_dir/etcd-root-password"
    et_random_hex "$job_dir/etcd-password"
    # Passwords go to the script in its environment, never on its command line.
    ETCDCTL_ENDPOINTS="https://${endpoint}" ETCDCTL_CACERT="$tls/ca.crt" \
        ETCDCTL_CERT="$tls/client.crt" ETCDCTL_KEY="$tls/client.key" \
        ETCD_ROOT_PASSWORD=$(<"$job_dir/etcd-root-password") \
        ETCD_PASSWORD=$(<"$job_dir/etcd-password") \
        ETCD_USERNAME=$ET_USER ETCD_KEY_PREFIX="${ET_KEY_PREFIX}/slurm-${SLURM_JOB_ID}/" \
        bash deploy/etcd/create-rendezvous-user.sh >/dev/null
    export ETCD_USERNAME=$ET_USER
    ETCD_PASSWORD=$(<"$job_dir/etcd-password")
    export ETCD_PASSWORD
    rdzv_conf="key_prefix=${ET_KEY_PREFIX}/,protocol=https,cacert=$tls/ca.crt"
    rdzv_conf+=",cert=$tls/client.crt,key=$tls/client.key"
}

# Stop this job's etcd and delete its data, the certificates, passwords and secret.
et_cleanup() {
    if [ -n "${etcd_pid:-}" ]; then
        kill "$etcd_pid" 2>/dev/null || true
        wait "$etcd_pid" 2>/dev/null || true
    fi
    [ -z "${etcd_dir:-}" ] || rm -rf "$etcd_dir"
    [ -z "${job_dir:-}" ] || rm -rf "$job_dir"
}
