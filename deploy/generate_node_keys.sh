#!/usr/bin/env bash
# An ECDSA key pair for SuperNode authentication (Flower 1.41).
#
# Usage: deploy/generate_node_keys.sh OUT_DIR [NAME]      (NAME defaults to "supernode")
#
# Writes OUT_DIR/NAME (private key, OpenSSH format, no passphrase, mode 600) and
# OUT_DIR/NAME.pub (public key, one "ecdsa-sha2-nistp384 ..." line).
#
# Flower 1.41 expects exactly this: the SuperNode loads the private key with
# `load_ssh_private_key` (OpenSSH format, unencrypted, an elliptic-curve key) from
# `--auth-supernode-private-key`, and derives the public key from it; the operator
# registers the public key (an OpenSSH public key on a NIST curve; P-384 here) with
#   flwr supernode register OUT_DIR/NAME.pub <connection>
# The private key never leaves the institution; only NAME.pub is sent to the operator.
set -euo pipefail

if [[ $# -lt 1 || "$1" == "-h" || "$1" == "--help" ]]; then
    awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
    exit $(( $# < 1 ? 2 : 0 ))
fi
out_dir=$1
name=${2:-supernode}
key="$out_dir/$name"
mkdir -p "$out_dir"
if [[ -e "$key" || -e "$key.pub" ]]; then
    echo "error: $key or $key.pub exists; remove it first (a node keeps its key)" >&2
    exit 1
fi

if command -v ssh-keygen >/dev/null; then
    ssh-keygen -q -t ecdsa -b 384 -N "" -C "fedsyn-$name" -f "$key"
else
    # Fallback without OpenSSH: the `cryptography` package (a Flower dependency).
    "${PYTHON:-python3}" - "$key" "$name" <<'EOF'
import os, sys
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
path, name = sys.argv[1], sys.argv[2]
key = ec.generate_private_key(ec.SECP384R1())
private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                            serialization.NoEncryption())
public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
with os.fdopen(fd, "wb") as f:
    f.write(private)
with open(path + ".pub", "wb") as f:
    f.write(public + f" fedsyn-{name}\n".encode())
EOF
fi
chmod 600 "$key"
echo "wrote $key (private: keep it on the node) and $key.pub (send to the SuperLink operator)"
