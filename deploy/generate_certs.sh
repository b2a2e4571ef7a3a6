#!/usr/bin/env bash
# Self-signed CA + server certificate for a fedsyn SuperLink (Flower 1.41).
#
# Usage: deploy/generate_certs.sh OUT_DIR [HOST_OR_IP ...]
#
# Writes to OUT_DIR:
#   ca.crt      the CA certificate: give it to every SuperNode (--root-certificates) and
#               to the operator's `flwr` CLI (root-certificates in config.toml); also the
#               SuperLink's --ssl-ca-certfile
#   ca.key      the CA's private key: keep it offline; it signs nothing else here
#   server.pem  the SuperLink's certificate (--ssl-certfile)
#   server.key  the SuperLink's private key (--ssl-keyfile)
#
# The certificate's subjectAltName always holds localhost, 127.0.0.1 and ::1: the
# SuperLink's own SuperExec connects to the Runtime API on 127.0.0.1 with the same
# certificate. Add the name(s) or address(es) SuperNodes use to reach the SuperLink,
# e.g. `deploy/generate_certs.sh certs superlink.example.org 10.0.0.5`.
# Validity: DAYS (default 365). Existing files are not overwritten unless FORCE=1.
set -euo pipefail

if [[ $# -lt 1 || "$1" == "-h" || "$1" == "--help" ]]; then
    awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
    exit $(( $# < 1 ? 2 : 0 ))
fi
command -v openssl >/dev/null || { echo "error: openssl is not installed" >&2; exit 1; }

out_dir=$1
shift
days=${DAYS:-365}
mkdir -p "$out_dir"
if [[ -e "$out_dir/server.pem" && "${FORCE:-0}" != "1" ]]; then
    echo "error: $out_dir/server.pem exists; set FORCE=1 to replace the certificates" >&2
    exit 1
fi

san="DNS:localhost,IP:127.0.0.1,IP:::1"
for name in "$@"; do
    if [[ "$name" =~ ^[0-9.]+$ || "$name" == *:* ]]; then
        san+=",IP:$name"
    else
        san+=",DNS:$name"
    fi
done
cn=${1:-localhost}

umask 077
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# CA
openssl genrsa -out "$out_dir/ca.key" 4096 2>/dev/null
openssl req -x509 -new -key "$out_dir/ca.key" -sha256 -days "$days" -subj "/CN=fedsyn SuperLink CA" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
    -out "$out_dir/ca.crt"

# Server key + CSR + certificate signed by the CA (SANs copied via an extension file)
openssl genrsa -out "$out_dir/server.key" 4096 2>/dev/null
openssl req -new -key "$out_dir/server.key" -subj "/CN=$cn" -out "$tmp/server.csr"
cat > "$tmp/server.ext" <<EOF
basicConstraints=CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth
subjectAltName=$san
EOF
openssl x509 -req -in "$tmp/server.csr" -CA "$out_dir/ca.crt" -CAkey "$out_dir/ca.key" -CAcreateserial \
    -CAserial "$tmp/ca.srl" -days "$days" -sha256 -extfile "$tmp/server.ext" -out "$out_dir/server.pem" 2>/dev/null

chmod 600 "$out_dir/ca.key" "$out_dir/server.key"
chmod 644 "$out_dir/ca.crt" "$out_dir/server.pem"
openssl verify -CAfile "$out_dir/ca.crt" "$out_dir/server.pem" >/dev/null
echo "wrote $out_dir/{ca.crt,ca.key,server.pem,server.key}; subjectAltName: $san"
