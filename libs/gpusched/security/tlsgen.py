"""A local certificate authority for `gpusched up --tls`: one CA, one server certificate for
127.0.0.1/localhost (and the host name), made once under DATA/tls. Clients verify the server
against `ca.pem` ($GPUSCHED_CA or the client config's `ca`).

The server certificate carries both extended key usages, `serverAuth` and `clientAuth`: a NATS
server presents it when it accepts a connection and also when it dials a route to its peers
(mutual TLS, `verify: true`), and a peer refuses a route certificate without `clientAuth`
("x509: certificate specifies an incompatible key usage"), so a cluster would never form. A
certificate made before this (serverAuth only) is reissued from the same CA when its key is here.

Bring your own: put `ca.pem`, `server.pem` and `server-key.pem` in DATA/tls before the first
start (they are used as they are), or point a deploy/ NATS config at yours.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import socket
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


def _write(path: Path, data: bytes, private: bool = False) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _key_pem(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def ensure(directory: str | os.PathLike, days: int = 825, hosts: tuple[str, ...] | list[str] = ()) -> dict[str, str]:
    """The CA and server certificate under `directory` (made when missing; `hosts`: more DNS
    names the server is reached by); returns the nats-server `tls` block's files."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    files = {"cert_file": d / "server.pem", "key_file": d / "server-key.pem", "ca_file": d / "ca.pem"}
    if all(p.exists() for p in files.values()):
        if (d / "ca-key.pem").exists() and not _both_usages(files["cert_file"]):
            _reissue(d, days)
        return {k: str(v) for k, v in files.items()}
    now = dt.datetime.now(dt.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "gpusched local CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
          .not_valid_after(now + dt.timedelta(days=days))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                       data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                       crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    names = [x509.DNSName(h) for h in dict.fromkeys(["localhost", socket.gethostname(), *hosts])] + [
        x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.IPAddress(ipaddress.ip_address("::1"))]
    _write(d / "ca-key.pem", _key_pem(ca_key), private=True)
    _write(files["ca_file"], ca.public_bytes(serialization.Encoding.PEM))
    _issue(d, ca, ca_key, names, days)
    return {k: str(v) for k, v in files.items()}


#: What a NATS server's certificate is used for: accepting clients and routes, dialling routes.
USAGES = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]


def _issue(d: Path, ca: x509.Certificate, ca_key, names: list, days: int) -> None:
    """A new server key and certificate for `names`, signed by the CA."""
    now = dt.datetime.now(dt.timezone.utc)
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "gpusched nats")]))
            .issuer_name(ca.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage(USAGES), critical=False)
            .sign(ca_key, hashes.SHA256()))
    _write(d / "server-key.pem", _key_pem(key), private=True)
    _write(d / "server.pem", cert.public_bytes(serialization.Encoding.PEM))


def _both_usages(cert_file: Path) -> bool:
    cert = x509.load_pem_x509_certificate(cert_file.read_bytes())
    try:
        have = set(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)
    except x509.ExtensionNotFound:
        return True  # no EKU at all: any use is allowed
    return set(USAGES) <= have


def _reissue(d: Path, days: int) -> None:
    """The server certificate again, same names, same CA, now with both usages."""
    old = x509.load_pem_x509_certificate((d / "server.pem").read_bytes())
    ca = x509.load_pem_x509_certificate((d / "ca.pem").read_bytes())
    ca_key = serialization.load_pem_private_key((d / "ca-key.pem").read_bytes(), password=None)
    names = list(old.extensions.get_extension_for_class(x509.SubjectAlternativeName).value)
    _issue(d, ca, ca_key, names, days)
