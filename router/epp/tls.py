"""The gRPC servers' TLS: the given certificate and key, or a self-signed pair made at start.

Gateways connect to an endpoint picker with TLS and do not verify its certificate (as in the
Gateway API Inference Extension's own picker), so a self-signed one made at start serves.
"""

from __future__ import annotations

import datetime
import ipaddress
import socket
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from router.config import EppSettings
from tracker.framework.errors import ConfigError


def self_signed(host: str = "localhost", days: int = 365) -> tuple[bytes, bytes]:
    """A new P-256 key and a certificate for it naming ``host``, this machine, localhost and
    loopback: ``(certificate PEM, key PEM)``."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvrouter-epp")])
    dns = {"localhost", socket.gethostname()}
    ips = {ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1")}
    try:
        ips.add(ipaddress.ip_address(host))
    except ValueError:
        dns.add(host)
    names: list[x509.GeneralName] = [x509.DNSName(d) for d in sorted(dns)]
    names += [x509.IPAddress(ip) for ip in sorted(ips, key=str)]
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return certificate.public_bytes(serialization.Encoding.PEM), key_pem


def server_credentials(settings: EppSettings) -> grpc.ServerCredentials | None:
    """The servers' credentials: None for plaintext (``--no-secure-serving``).

    :raises ConfigError: the certificate or key cannot be read.
    """
    if not settings.secure_serving:
        return None
    if settings.tls_cert is None or settings.tls_key is None:
        certificate, key = self_signed(settings.host)
    else:
        try:
            certificate = Path(settings.tls_cert).read_bytes()
            key = Path(settings.tls_key).read_bytes()
        except OSError as exc:
            raise ConfigError(f"tls: cannot read {exc.filename}: {exc.strerror}") from None
    return grpc.ssl_server_credentials([(key, certificate)])
