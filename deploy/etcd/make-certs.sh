#!/usr/bin/env bash
# Create a throwaway CA, an etcd server certificate and a client certificate
# for the rendezvous, with openssl.
#
#   deploy/etcd/make-certs.sh OUT_DIR [EXTRA_SAN ...]
#
# OUT_DIR gets ca.crt/ca.key, server.crt/server.key (also used for peer
# traffic) and client.crt/client.key (CN = the rendezvous user). The server
# certificate covers localhost, 127.0.0.1 and the in-cluster names of
# k8s/base; pass further DNS names or IP addresses as EXTRA_SAN.
# Keys are created 0600; nothing is printed that is secret.
set -euo pipefail

if [ $# -lt 1 ]; then
    echo "usage: $0 OUT_DIR [EXTRA_SAN ...]" >&2
    exit 2
fi
out=$1
shift
namespace=${ETCD_NAMESPACE:-elastic-train}
client_cn=${ETCD_CLIENT_CN:-elastic-train}
days=${CERT_DAYS:-365}

sans="DNS:localhost,IP:127.0.0.1,DNS:etcd,DNS:etcd.${namespace}.svc"
sans+=",DNS:*.etcd-peers.${namespace}.svc,DNS:etcd.${namespace}.svc.cluster.local"
sans+=",DNS:*.etcd-peers.${namespace}.svc.cluster.local"
for san in "$@"; do
    if [[ $san =~ ^[0-9.]+$ || $san == *:* ]]; then
        sans+=",IP:${san}"
    else
        sans+=",DNS:${san}"
    fi
done

mkdir -p "$out"
umask 077
cd "$out"

# ECDSA P-256 keys: what etcd, Go and gRPC handle natively, and quick to make.
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -sha256 -nodes -days "$days" \
    -keyout ca.key -out ca.crt -subj "/CN=elastic-train etcd CA" \
    -addext "basicConstraints=critical,CA:TRUE" \
    -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null

issue() {  # issue NAME CN EXTENDED_KEY_USAGE [SUBJECT_ALT_NAMES]
    local name=$1 cn=$2 eku=$3 san=${4:-}
    local ext="basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature
extendedKeyUsage=${eku}"
    [ -n "$san" ] && ext+="
subjectAltName=${san}"
    openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -sha256 -nodes -keyout "${name}.key" \
        -out "${name}.csr" -subj "/CN=${cn}" 2>/dev/null
    openssl x509 -req -sha256 -days "$days" -in "${name}.csr" -CA ca.crt -CAkey ca.key \
        -CAcreateserial -out "${name}.crt" -extfile <(printf '%s\n' "$ext") 2>/dev/null
    rm -f "${name}.csr"
}

# The server certificate is also the peer certificate, hence clientAuth too.
issue server etcd serverAuth,clientAuth "$sans"
issue client "$client_cn" clientAuth
rm -f ca.srl
chmod 0644 ca.crt server.crt client.crt
echo "wrote ca.crt server.crt server.key client.crt client.key to $out"
