"""Test certificates (cryptography): a CA and leaf certificates for 127.0.0.1 / localhost."""

from __future__ import annotations

import datetime as dt
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write(path: Path, key, cert) -> tuple[Path, Path]:
    kp, cp = path.with_suffix(".key"), path.with_suffix(".crt")
    kp.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                     serialization.PrivateFormat.PKCS8,
                                     serialization.NoEncryption()))
    cp.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return cp, kp


class TestCA:
    __test__ = False  # not a pytest class

    def __init__(self, directory: Path, name: str = "remp-test-ca"):
        self.dir = directory
        self.key = ec.generate_private_key(ec.SECP256R1())
        now = dt.datetime.now(dt.timezone.utc)
        self.cert = (x509.CertificateBuilder().subject_name(_name(name)).issuer_name(_name(name))
                     .public_key(self.key.public_key()).serial_number(x509.random_serial_number())
                     .not_valid_before(now - dt.timedelta(minutes=5))
                     .not_valid_after(now + dt.timedelta(days=1))
                     .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                     .sign(self.key, hashes.SHA256()))
        self.cert_path, _ = _write(directory / name, self.key, self.cert)

    def issue(self, name: str, server: bool, client: bool | None = None) -> tuple[Path, Path]:
        """(certificate, key) for 127.0.0.1 and localhost, for a server or a client (or both:
        ``server=True, client=True`` — a service that also calls others)."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = dt.datetime.now(dt.timezone.utc)
        client = (not server) if client is None else client
        usage = [u for u, on in ((ExtendedKeyUsageOID.SERVER_AUTH, server),
                                 (ExtendedKeyUsageOID.CLIENT_AUTH, client)) if on]
        cert = (x509.CertificateBuilder().subject_name(_name(name))
                .issuer_name(self.cert.subject).public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - dt.timedelta(minutes=5))
                .not_valid_after(now + dt.timedelta(days=1))
                .add_extension(x509.SubjectAlternativeName([
                    x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                    critical=False)
                .add_extension(x509.ExtendedKeyUsage(usage), critical=False)
                .sign(self.key, hashes.SHA256()))
        return _write(self.dir / name, key, cert)
